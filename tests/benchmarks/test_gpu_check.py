"""benchmarks/gpu_check.py: it refuses without CUDA and runs end to end with --device cpu."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_cleanly_without_cuda(capsys):
    assert _load().main([]) == 2
    assert "--device cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_smoke_run_writes_every_section(tmp_path):
    import torch.distributed as dist

    out = tmp_path / "gpu_check.json"
    assert _load().main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["ok"] and all(r["ok"] for r in doc["cuda_vs_cpu"])
    assert all(r["max_abs_diff"] == 0.0 for r in doc["cuda_vs_cpu"])  # the CPU against itself
    assert doc["step_cost"]["ratio_wall_median"] > 0
    assert doc["compression"]["encode_gb_s"] > 0 and doc["compression"]["decode_gb_s"] > 0
    from lowband.train.methods import METHODS

    assert [r["method"] for r in doc["bf16_training"]] == list(METHODS)
    assert all(r["finite"] and r["peak_bytes"] is None for r in doc["bf16_training"])
    assert not dist.is_initialized()  # the one-rank group is gone again


def test_step_cost_steps_flexdemo_on_the_same_gradients_every_round(monkeypatch):
    # FlexDeMo writes its momentum over the gradients; benchmarks/step_cost.py must hand every timed
    # FlexDeMo step the original gradients (else it would time steps on the previous momentum).
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    step_cost = importlib.import_module("step_cost")
    seen = []
    build = step_cost.build_flexdemo

    def recording_build(*args, **kwargs):
        opt = build(*args, **kwargs)
        step = opt.step

        def recording_step(*a, **k):
            seen.append([p.grad.clone() for group in opt.param_groups for p in group["params"]])
            return step(*a, **k)

        opt.step = recording_step
        return opt

    monkeypatch.setattr(step_cost, "build_flexdemo", recording_build)
    shards = [("w", torch.randn(300, 128)), ("b", torch.randn(77))]
    cost = step_cost.time_steps(shards, model="toy", vocab_size=0, n_shards=1, repeats=3, warmup=1)
    assert len(cost.flexdemo_cpu_s) == 3 and len(seen) == 4
    for grads in seen[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads, seen[0], strict=True))
