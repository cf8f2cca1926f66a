"""A sighting, not a benchmark: the fork's llama-server (-np 4) on a ZipMoE GGUF under a 20 GiB cap, four
chat requests of 64 tokens at once, the server's anonymous memory (RssAnon) sampled every 50 ms and
grouped by the pool changes logged so far, so that a re-plan's change (the "re-planned after N decode
steps ... F ..." line is logged once it is done) shows how memory moved while it ran.

    .venv/bin/python bench/rss_during_replan.py bench/work/qwen24.zipmoe.gguf [OUT.json]
"""
import json, subprocess, sys, time, threading, urllib.request, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent / "llama-server"  # as bench/llama_server_bench.py runs it
model, port, log = sys.argv[1], 8099, "/tmp/rss_during_replan.log"
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp/rss_during_replan.json"
cmd = [sys.executable, str(ROOT.parent / "shared" / "tools" / "capped-run"), "--mem", "20G", "--evict", model, "--",
       str(BIN), "-m", model, "-np", "4", "-c", "2048", "--no-warmup", "-lv", "4", "--host", "127.0.0.1", "--port", str(port)]
proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
url = f"http://127.0.0.1:{port}"
while True:
    try:
        urllib.request.urlopen(url + "/health", timeout=1); break
    except Exception:
        time.sleep(0.5)
pid = subprocess.run(["pgrep", "-f", f"port {port}$"], capture_output=True, text=True).stdout.split()
pid = [p for p in pid if "capped-run" not in open(f"/proc/{p}/cmdline").read()][0]
samples, done = [], False
def sample():
    while not done:
        try:
            st = open(f"/proc/{pid}/status").read()
            anon = int(re.search(r"RssAnon:\s+(\d+)", st).group(1)) * 1024
            text = open(log, errors="replace").read()
            phase = sum(1 for l in text.splitlines() if "re-planned after" in l and "kept" not in l)
            samples.append((time.time(), anon, phase))
        except Exception:
            pass
        time.sleep(0.05)
th = threading.Thread(target=sample); th.start()
def ask(p):
    body = json.dumps({"messages": [{"role": "user", "content": p}], "max_tokens": 64, "temperature": 0}).encode()
    urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"}), timeout=900).read()
ts = [threading.Thread(target=ask, args=(p,)) for p in ["Tell me a story.", "What is a mixture of experts?", "Count to five.", "Name a colour."]]
[t.start() for t in ts]; [t.join() for t in ts]
done = True; th.join()
subprocess.run(["pkill", "-TERM", "-f", f"[-]-port {port}"]); proc.wait()
for ph in sorted(set(s[2] for s in samples)):
    a = [s[1] for s in samples if s[2] == ph]
    print(f"changes so far {ph}: RssAnon max {max(a)/2**30:.2f} GiB, last {a[-1]/2**30:.2f} GiB, {len(a)} samples")
print("overall max %.2f GiB" % (max(s[1] for s in samples) / 2**30)); json.dump(samples, open(out, "w"))
print([l[l.index("ZipMoE pools re-planned"):][:200] for l in open(log, errors="replace") if "re-planned after" in l])
