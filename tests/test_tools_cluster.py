"""labs/check_cluster.py and labs/comm_bench.py at world sizes 2 and 4 (CPU, gloo).

check_cluster must pass on a healthy world, name the rank when one sends wrong data, and reject
bad flags with one line and exit 2. comm_bench must report every op and size with the nccl-tests
bus-bandwidth factors. All launches run at once; each has a hard timeout.
"""

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from launcher import LABS, PYTHON, REPO, torchrun_cmd

TIMEOUT = 240
OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
# nccl-tests doc/PERFORMANCE.md: busbw = algbw * factor
NCCL_TESTS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
                     "all_gather": lambda n: (n - 1) / n,
                     "reduce_scatter": lambda n: (n - 1) / n,
                     "all_to_all": lambda n: (n - 1) / n,
                     "broadcast": lambda n: 1.0}


def launch(cmd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=TIMEOUT,
                          env=env, cwd=REPO)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    check, bench = LABS / "check_cluster.py", LABS / "comm_bench.py"
    small = ["--min-bytes", "4K", "--max-bytes", "256K", "--iters", "3", "--warmup", "1"]
    jobs = {
        "check2": torchrun_cmd(check, 2, ["--json-out", tmp / "check2.json"]),
        "check4": torchrun_cmd(check, 4, ["--json-out", tmp / "check4.json"]),
        "check_bad": torchrun_cmd(check, 2, ["--inject-bad-rank", "1"]),
        "check_flag": [PYTHON, check, "--timeout-s", "0"],
        "bench2": torchrun_cmd(bench, 2, [*small, "--json-out", tmp / "bench2.json"]),
        "bench4": torchrun_cmd(bench, 4, [*small, "--json-out", tmp / "bench4.json"]),
        "bench_flag": [PYTHON, bench, "--ops", "all_reduce,allreduce"],
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(launch, cmd) for name, cmd in jobs.items()}
        out = {name: f.result() for name, f in futures.items()}
    for name in ("check2", "check4", "bench2", "bench4"):
        rc, text = out[name]
        assert rc == 0, f"{name} failed:\n{text}"
        out[name] = (text, json.loads((tmp / f"{name}.json").read_text()))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_check_cluster_passes_on_a_healthy_world(results, world_size):
    text, report = results[f"check{world_size}"]
    assert report["ok"] and report["world_size"] == world_size and not report["failures"]
    assert [r["rank"] for r in report["ranks"]] == list(range(world_size))
    assert {r["backend"] for r in report["ranks"]} == {"gloo"}
    assert set(report["max_seconds"]) == {"all_gather", "all_reduce", "all_to_all",
                                          "broadcast", "barrier"}
    assert text.strip().splitlines()[-1].startswith(f"check_cluster: OK | gloo x{world_size} | ")


def test_check_cluster_names_the_bad_rank(results):
    rc, text = results["check_bad"]
    assert rc == 1, text
    assert "FAILED all_to_all on rank 0: wrong data from ranks [1]" in text
    assert "check_cluster: FAILED | gloo x2" in text


def test_tools_reject_bad_flags_with_one_line(results):
    for name, flag in (("check_flag", "--timeout-s"), ("bench_flag", "--ops")):
        rc, text = results[name]
        assert rc == 2 and len(text.strip().splitlines()) == 1 and flag in text, text


@pytest.mark.parametrize("world_size", [2, 4])
def test_comm_bench_uses_nccl_tests_bus_bandwidth(results, world_size):
    text, report = results[f"bench{world_size}"]
    assert report["world_size"] == world_size and report["backend"] == "gloo"
    assert sorted({row["op"] for row in report["rows"]}) == sorted(OPS)
    for op in OPS:
        rows = [r for r in report["rows"] if r["op"] == op]
        assert [r["bytes"] for r in rows] == [4096, 16384, 65536, 262144]
        for row in rows:
            assert row["time_us"] > 0
            assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
            factor = NCCL_TESTS_FACTOR[op](world_size)
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
    assert report["memcpy_gbps"] > 0 and report["memcpy_bytes"] == 256 * 1024
    assert text.strip().splitlines()[-1].startswith(f"comm_bench: gloo x{world_size} | cpu x")
