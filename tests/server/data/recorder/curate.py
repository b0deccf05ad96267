import json
import os
out, seen = [], set()
scen = None
def sig(path, b):
    def shape(v):
        if isinstance(v, dict): return tuple(sorted((k, shape(x)) for k, x in v.items()))
        if isinstance(v, list): return tuple(sorted({shape(x) for x in v}, key=repr))
        return type(v).__name__
    return (path, shape(b))
for line in open("all.jsonl"):
    e = json.loads(line)
    if e["path"] == "/__marker":
        scen = e["body"]["scenario"]; continue
    if not e["path"].startswith("/v1/") or e["method"] != "POST" or scen == "end":
        continue
    client = next((c for c in ("litellm", "lm-eval", "guidellm") if scen.startswith(c)), "langchain-openai")
    use = scen if client == "langchain-openai" else scen[len(client):].strip()
    if client == "lm-eval" and "remote" in use:
        continue  # its ids come from the probe's toy /tokenize, not the model's tokenizer
    s = sig(e["path"], e["body"]) + (client, use)
    if s in seen: continue
    seen.add(s)
    out.append({"client": client, "use": use, "path": e["path"], "body": e["body"]})
# one request per (client, use): the first
keep = out
print(len(keep))
for r in keep: print(r["client"], "|", r["use"], "|", r["path"], sorted(r["body"]))
json.dump(keep, open(os.path.join(os.path.dirname(__file__), "..", "client_requests.json"), "w"), indent=1)
