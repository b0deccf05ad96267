"""The `brisk` command as a user runs it: a real subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest

from brisk import SamplingParams
from brisk.config import ConfigError

pytestmark = pytest.mark.real_model


def _brisk(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "brisk.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_generate_streams_the_same_text_as_the_offline_api(real_llm):
    result = _brisk("generate", "The capital of France is", "--raw", "--temperature", "0", "--max-tokens", "12",
                    "--max-model-len", "512", "--kv-cache-memory-gib", "0.1", "--dtype", "float32", "--quantization",
                    "none")
    assert result.returncode == 0, result.stderr
    expected = real_llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=12),
                                 use_tqdm=False)[0].outputs[0].text
    assert result.stdout == expected + "\n"
    assert "INFO brisk.engine: loaded SmolLM2-135M-Instruct.Q4_1.gguf (llama): weights float32 (dequantized): " \
           "the file's Q4_1+Q8_0 dequantized to float32; dtype float32; kernels " in result.stderr  # said at start


def test_chat_keeps_the_conversation(real_llm):
    result = _brisk("chat", "--temperature", "0", "--max-tokens", "16", "--max-model-len", "512",
                    "--kv-cache-memory-gib", "0.1", "--dtype", "float32", "--quantization", "none",
                    stdin="What is 2+2?\nAnd times 3?\n\n")
    assert result.returncode == 0, result.stderr
    replies = [line.strip() for line in result.stdout.split("> ") if line.strip()]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)

    def answer(conversation):
        return real_llm.chat(conversation, greedy, use_tqdm=False)[0].outputs[0].text

    first_turn = [{"role": "user", "content": "What is 2+2?"}]
    first = answer(first_turn)
    second_turn = {"role": "user", "content": "And times 3?"}
    with_history = answer(first_turn + [{"role": "assistant", "content": first}, second_turn])
    alone = answer([second_turn])
    assert with_history.strip() != alone.strip()  # else this test could not tell whether history is used
    assert replies == [first.strip(), with_history.strip()]


def test_export_tokenizer_writes_a_folder_transformers_loads(tmp_path, real_llm, capsys):
    """What guidellm and lm-eval do with a tokenizer folder: AutoTokenizer.from_pretrained, then
    encode, decode and render the chat template, all as brisk does."""
    from transformers import AutoTokenizer

    from brisk.cli import main
    from brisk.model.tokenizer import continue_final_message

    folder = tmp_path / "tokenizer"
    result = _brisk("export-tokenizer", str(folder))
    assert result.returncode == 0, result.stderr
    hf, ours = AutoTokenizer.from_pretrained(str(folder)), real_llm.tokenizer
    for text in ("The capital of France is", "Hello,  world! It's a test .", "héllo 😀\n\n<|im_start|>user", ""):
        ids = ours.encode(text)
        assert hf(text)["input_ids"] == ids and hf.decode(ids) == ours.decode(ids, skip_special_tokens=False)
    assert (hf.eos_token_id, hf.bos_token_id, hf.model_max_length) == (ours.eos_token_id, ours.bos_token_id, 8192)
    chat = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how"}]
    for generation_prompt in (True, False):
        assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt) \
            == ours.apply_chat_template(chat, generation_prompt)
    assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=False, continue_final_message=True) \
        == continue_final_message(ours.apply_chat_template(chat, False), chat)
    assert main(["export-tokenizer", str(folder)]) == 2  # a folder with files in it is never overwritten
    assert "is not an empty folder" in capsys.readouterr().err


def test_bad_options_exit_with_a_clear_error():
    result = _brisk("generate", "hi", "--dtype", "float8")
    assert result.returncode == 2 and "dtype must be" in result.stderr
    result = _brisk("eval", "perplexity", "--context-len", "512", "--stride", "512")
    assert result.returncode == 2 and "--stride must be in 1..511" in result.stderr
    result = _brisk("eval", "perplexity", "--text", "/no/such/book.txt")
    assert result.returncode == 2 and "no text at /no/such/book.txt" in result.stderr


def test_every_command_prints_its_help():
    """Help strings go through argparse's %-formatting: one stray % broke every command's --help."""
    from brisk.cli import build_parser

    parser = build_parser()
    commands = [[name] for name in ("generate", "chat", "serve", "quantize", "export-tokenizer")]
    commands += [["bench", kind] for kind in ("throughput", "prefix", "fairness", "sampling", "step", "quant")]
    commands += [["eval", "perplexity"]]
    for command in commands:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([*command, "--help"])
        assert exited.value.code == 0, command


def test_serve_takes_the_model_as_a_positional_argument_as_vllm_serve_does(tmp_path):
    from brisk.args import parse_args
    from brisk.cli import build_parser

    def model(*argv):
        return parse_args(build_parser(), ["serve", *argv]).model

    assert model("some/model.gguf", "--port", "9000") == "some/model.gguf"
    assert model("--model", "some/model.gguf") == "some/model.gguf"
    assert model("some/model.gguf", "--model", "some/model.gguf") == "some/model.gguf"
    assert model() is None  # the default model
    config = tmp_path / "serve.yaml"
    config.write_text("model: from/the/file.gguf\nmax_num_seqs: 8\n")
    assert model("--config", str(config)) == "from/the/file.gguf"
    assert model("on/the/command/line.gguf", "--config", str(config)) == "on/the/command/line.gguf"
    with pytest.raises(ConfigError, match="name different models"):
        model("one.gguf", "--model", "other.gguf")
