"""benchmarks/fleet_pull.py, the GPU run's script (nixl against NCCL's send/recv at 16k tokens), in its tiny CPU
mode: it runs end to end and prints the table the GPU run will, each pull checked byte for byte by the script."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_mode_prints_the_table(tmp_path):
    out = tmp_path / "pull.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "fleet_pull.py"), "--tiny", "--backends",
                           "send_recv", "tcp", "--lengths", "64,256", "--repeats", "2", "--result-json", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "| backend | tokens | MiB | ms | GB/s | of send_recv |" in lines
    table = [line for line in lines if line.startswith(("| send_recv |", "| tcp |"))]
    assert [line.split("|")[1:3] for line in table] == [[" send_recv ", " 64 "], [" send_recv ", " 256 "],
                                                        [" tcp ", " 64 "], [" tcp ", " 256 "]]
    assert any(line.startswith("tcp at 256 tokens: ") and "of send_recv's bandwidth" in line for line in lines)
    rows = json.loads(out.read_text())["rows"]
    per_token = 2 * 2 * 2 * 16 * 2                      # --tiny: 2 layers, K and V, 2 heads of 16, bf16
    assert [(r["backend"], r["tokens"], r["bytes"]) for r in rows] == \
        [(b, n, n * per_token) for b in ("send_recv", "tcp") for n in (64, 256)]
    assert all(r["seconds"] > 0 for r in rows) and rows[0]["of_send_recv"] == 1.0
