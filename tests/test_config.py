"""EngineConfig's checks; ServerConfig's names and flags; ClusterConfig's checks."""

from __future__ import annotations

import argparse

import pytest

from brisk.args import add_config_arguments, config_flags, config_from_args
from brisk.config import ClusterConfig, ConfigError, EngineConfig, ServerConfig
from tests.helpers import GEMMA_TURNS


def test_served_model_name_takes_one_name_or_several_aliases():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, ServerConfig, "server options")
    config = config_from_args(ServerConfig, parser.parse_args(["--served-model-name", "a", "org/b"]))
    assert config.served_model_name == ["a", "org/b"]
    assert config_from_args(ServerConfig, parser.parse_args(config_flags(config))) == config  # flags round-trip
    assert ServerConfig(served_model_name="a").served_model_name == ["a"]
    assert ServerConfig().served_model_name is None
    for names in ([], ["a", ""], ["a", "a"]):
        with pytest.raises(ConfigError, match="served_model_name"):
            ServerConfig(served_model_name=names)


def test_speculative_config_comes_as_a_dict_or_json_and_round_trips_through_flags():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    spec = config.speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (3, 5, 5)  # as vLLM
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig, "engine")
    assert config_from_args(EngineConfig, parser.parse_args(config_flags(config))) == config
    assert EngineConfig(speculative_config='{"prompt_lookup_min": 2}').speculative_config.prompt_lookup_max == 2


@pytest.mark.parametrize("value, names", [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_spec_tokens": 2}, "num_spec_tokens"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
])
def test_a_bad_speculative_config_names_what_is_wrong(value, names):
    with pytest.raises(ConfigError, match=names):
        EngineConfig(speculative_config=value)


def test_quantization_defaults_to_auto_and_none_names_the_float_weights():
    assert EngineConfig().quantization == "auto"
    assert EngineConfig(quantization=None).quantization == "none"  # what the float weights were called before
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig, "engine")
    for value in ("none", "auto", "gguf"):  # a flag that rebuilds the config, "none" included
        config = EngineConfig(quantization=value)
        assert config_from_args(EngineConfig, parser.parse_args(config_flags(config))) == config


@pytest.mark.parametrize("kwargs, names", [
    (dict(quantization="int3"), "quantization must be one of auto, none, int8"),
    (dict(quantization="none", int8_activations=True), "int8_activations needs .* not none"),
    (dict(quantization="nf4", int8_activations=True), "int8_activations needs .* not nf4"),
])
def test_a_bad_quantization_names_the_field(kwargs, names):
    with pytest.raises(ConfigError, match=names):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, names", [
    (dict(replicas=0), "replicas must be >= 1"),
    (dict(min_replicas=1), "min_replicas and max_replicas go together"),
    (dict(min_replicas=3, max_replicas=2), "exceeds max_replicas"),
    (dict(replicas=2, min_replicas=1, max_replicas=2), "not both"),
    (dict(replicas=2, routing="random"), "routing must be one of"),
    (dict(replicas=2, target_ongoing_requests=0), "target_ongoing_requests must be > 0"),
])
def test_a_bad_cluster_config_names_what_is_wrong(kwargs, names):
    with pytest.raises(ConfigError, match=names):
        ClusterConfig(**kwargs)


def test_replicas_or_an_autoscaling_range_turn_the_cluster_on():
    assert not ClusterConfig().enabled
    assert ClusterConfig(replicas=2).enabled and ClusterConfig(min_replicas=1, max_replicas=3).enabled


def test_chat_template_is_a_file_or_the_template_itself_as_vllm_reads_it(tmp_path):
    path = tmp_path / "gemma.jinja"
    path.write_text(GEMMA_TURNS, encoding="utf-8")
    assert EngineConfig(chat_template=str(path)).chat_template == GEMMA_TURNS
    config = EngineConfig(chat_template=GEMMA_TURNS)
    assert config.chat_template == GEMMA_TURNS
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig, "engine")
    assert config_from_args(EngineConfig, parser.parse_args(config_flags(config))) == config  # to another process
    assert EngineConfig().chat_template is None


@pytest.mark.parametrize("value, names", [
    ("templates/gemma.jinja", "chat_template 'templates/gemma.jinja' looks like a file path, but it cannot be read"),
    ("{% for m in messages %}{{ m['content'] }}",
     r"chat_template is not a valid Jinja template: Unexpected end of template.* \(line 1\)"),
])
def test_a_bad_chat_template_names_the_field(value, names):
    with pytest.raises(ConfigError, match=names):
        EngineConfig(chat_template=value)


def test_a_bad_chat_template_stops_every_command_before_anything_loads(capsys):
    from brisk.cli import main

    for command in (["serve"], ["chat"], ["generate", "hi"]):
        assert main([*command, "--chat-template", "no-such-template.jinja"]) == 2
        assert "chat_template 'no-such-template.jinja' looks like a file path" in capsys.readouterr().err
