import os, sys, json, tempfile, httpx
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["HF_DATASETS_OFFLINE"] = "1"
import lm_eval
from lm_eval.tasks import TaskManager
BASE = "http://127.0.0.1:18765"
DATA = os.path.join(os.path.dirname(__file__), "..")
def mark(name): httpx.post(BASE + "/__marker", json={"scenario": name})
tmp = tempfile.mkdtemp()
for name in ("brisk_mc", "brisk_gen"):
    y = open(f"{DATA}/{name}.yaml").read().replace(f"tests/server/data/{name}.jsonl", f"{DATA}/{name}.jsonl")
    open(f"{tmp}/{name}.yaml", "w").write(y)
tm = TaskManager(include_path=tmp, include_defaults=False)
scen = sys.argv[1]
mark("lm-eval " + scen)
if scen == "completions-mc-hf":
    r = lm_eval.simple_evaluate(model="local-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/completions", tokenizer_backend="huggingface", tokenizer=os.environ["TOKENIZER_DIR"]), tasks=["brisk_mc"], task_manager=tm, limit=2)
elif scen == "completions-mc-hf-batch":
    r = lm_eval.simple_evaluate(model="local-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/completions", tokenizer_backend="huggingface", tokenizer=os.environ["TOKENIZER_DIR"], batch_size=4), tasks=["brisk_mc"], task_manager=tm, limit=1)
elif scen == "completions-mc-text":
    r = lm_eval.simple_evaluate(model="local-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/completions", tokenizer_backend="huggingface", tokenizer=os.environ["TOKENIZER_DIR"], tokenized_requests=False), tasks=["brisk_mc"], task_manager=tm, limit=1)
elif scen == "completions-mc-auto":
    r = lm_eval.simple_evaluate(model="local-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/completions", tokenizer=os.environ["TOKENIZER_DIR"]), tasks=["brisk_mc"], task_manager=tm, limit=1)
elif scen == "completions-gen":
    r = lm_eval.simple_evaluate(model="local-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/completions", tokenizer_backend="huggingface", tokenizer=os.environ["TOKENIZER_DIR"]), tasks=["brisk_gen"], task_manager=tm, limit=1)
elif scen == "chat-gen":
    r = lm_eval.simple_evaluate(model="local-chat-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/chat/completions"), tasks=["brisk_gen"], task_manager=tm, limit=1, apply_chat_template=True)
elif scen == "completions-mc-concurrent":
    r = lm_eval.simple_evaluate(model="local-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/completions", tokenizer_backend="huggingface", tokenizer=os.environ["TOKENIZER_DIR"], num_concurrent=2), tasks=["brisk_mc"], task_manager=tm, limit=1)
if scen == "completions-mc-remote":
    r = lm_eval.simple_evaluate(model="local-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/completions", tokenizer_backend="remote"), tasks=["brisk_mc"], task_manager=tm, limit=1)
if scen == "completions-mc-auto-remote":
    r = lm_eval.simple_evaluate(model="local-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/completions"), tasks=["brisk_mc"], task_manager=tm, limit=1)
if scen == "completions-gen-remote":
    r = lm_eval.simple_evaluate(model="local-completions", model_args=dict(model="smollm2", base_url=BASE + "/v1/completions", tokenizer_backend="remote"), tasks=["brisk_gen"], task_manager=tm, limit=1)
print(json.dumps(r["results"], default=str))
