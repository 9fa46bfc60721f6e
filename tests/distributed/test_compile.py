"""lowband/distributed/compile.py: --compile's blocks compiled in place, and refused where torch.compile cannot run.

(That compiled blocks train as eager ones do, under every method, is tests/e2e/test_golden.py's.)
"""

from __future__ import annotations

import pytest


@pytest.fixture
def no_cxx(monkeypatch):
    """Inductor's compiler candidates: none on this machine."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/lowband-test-c++"))
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)


def test_no_cpp_compiler_is_refused_with_the_fix(no_cxx):
    from lowband.distributed.compile import check_compile

    with pytest.raises(ValueError, match=r"needs a C\+\+ compiler.*lowband-test-c\+\+.*apt-get install g\+\+.*\$CXX"):
        check_compile("inductor", "cpu")
    check_compile("aot_eager", "cpu")  # traces, but generates no kernels: needs no compiler


def test_no_triton_on_a_gpu_and_an_unsupported_python_are_refused_with_the_fix(monkeypatch):
    import torch._dynamo.eval_frame
    import torch.utils._triton

    from lowband.distributed.compile import check_compile

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    with pytest.raises(ValueError, match="needs Triton.*pip install triton"):
        check_compile("inductor", "cuda")

    def unsupported():
        raise RuntimeError("Python 3.15+ not yet supported for torch.compile")

    monkeypatch.setattr(torch._dynamo.eval_frame, "check_if_dynamo_supported", unsupported)
    with pytest.raises(ValueError, match="cannot run on this Python.*3.15.*leave --compile out"):
        check_compile("inductor", "cpu")
    with pytest.raises(ValueError, match="backend must be one of inductor, aot_eager, got 'tvm'"):
        check_compile("tvm", "cpu")


def test_blocks_are_compiled_in_place_keeping_parameter_names(monkeypatch):
    import torch._dynamo.config

    from lowband.distributed.compile import compile_blocks

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # restored after the test
    from lowband.train.models import build_model, transformer_blocks

    model = build_model("gpt-tiny", vocab_size=64, seed=0).model
    names = list(model.state_dict())
    blocks = transformer_blocks(model)
    assert compile_blocks(blocks, "aot_eager") == blocks
    assert all(b._compiled_call_impl is not None for b in blocks)  # compiled at the first call
    assert list(model.state_dict()) == names  # checkpoints load with and without --compile
    assert torch._dynamo.config.recompile_limit == 64  # shared by all blocks: see compile_blocks
    with pytest.raises(ValueError, match="no recognised block list.*leave --compile out"):
        compile_blocks([], "inductor")


def test_train_and_bench_refuse_compile_without_a_compiler_before_anything_runs(no_cxx, tmp_path):
    from lowband.bench.config import BenchConfig
    from lowband.train.args import parse_train_args

    cfg = parse_train_args(["--compile", "--out", str(tmp_path / "run")])
    assert cfg.model.compile and not parse_train_args([]).model.compile
    with pytest.raises(ValueError, match=r"--compile on the CPU needs a C\+\+ compiler"):
        cfg.validate()
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"--compile on the CPU needs a C\+\+ compiler"):
        BenchConfig.from_tables({"bench": {"methods": ("adamw",)}, "model": {"compile": True}})
