"""Bad input as a new user gives it: every case a clear error naming the argument (library), one
`error:` line and exit status 2 (CLI), or a file:line message (data). Plus the documented NaN and
accuracy behaviour at the edges, and the GPU runner's resume of a test run cut short."""
import os
import re
import subprocess
import sys

import pytest
import torch

import erase_triton as et
from erase_triton import LocalHead, Scheduler, fused_local_head, reference
from erase_triton.cli import main
from erase_triton.data import DataError, load_movielens
from erase_triton.metrics import auc, normalized_entropy

BACKENDS = ["torch"] + (["triton"] if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" else [])
H, W, Y = torch.randn(4, 8), torch.randn(3, 8), torch.rand(4, 3).round()
YCE = torch.zeros(4, dtype=torch.long)


# ------------------------------------------------------------------------------ library
LIBRARY = [
    ("C=0", lambda be: fused_local_head(H, torch.randn(0, 8), None, torch.rand(4, 0), backend=be), ValueError,
     "supports 1 <= C <= 64"),
    ("D=0 ce", lambda be: fused_local_head(torch.randn(4, 0), torch.randn(3, 0), None, YCE, loss="ce", backend=be),
     ValueError, "weight must have D >= 1"),
    ("bias list", lambda be: fused_local_head(H, W, [0.0, 0.0, 0.0], Y, backend=be), TypeError, "bias must be"),
    ("occupancy str", lambda be: fused_local_head(H, W, None, Y, occupancy="0.5", backend=be), ValueError, "occupancy"),
    ("occupancy list", lambda be: fused_local_head(H, W, None, Y, occupancy=[0.5], backend=be), ValueError,
     "occupancy"),
    ("occupancy bool", lambda be: fused_local_head(H, W, None, Y, occupancy=True, backend=be), ValueError,
     "occupancy"),
    ("ignore_index None", lambda be: fused_local_head(H, W, None, YCE, loss="ce", ignore_index=None, backend=be),
     TypeError, "ignore_index must be an int"),
    ("ignore_index float", lambda be: fused_local_head(H, W, None, YCE, loss="ce", ignore_index=2.5, backend=be),
     TypeError, "ignore_index must be an int"),
    ("bce C=65", lambda be: fused_local_head(H, torch.randn(65, 8), None, torch.rand(4, 65), backend=be), ValueError,
     "supports 1 <= C <= 64"),
    ("mse C=65", lambda be: fused_local_head(H, torch.randn(65, 8), None, torch.rand(4, 65), loss="mse", backend=be),
     ValueError, "supports 1 <= C <= 64"),
    ("ce C=131073", lambda be: fused_local_head(H, torch.randn(131073, 8), None, YCE, loss="ce", backend=be),
     ValueError, "supports 2 <= C <= 131072"),
    ("reduction none", lambda be: fused_local_head(H, W, None, Y, reduction="none", backend=be), ValueError,
     "reduction must be"),
    ("config not a LaunchConfig", lambda be: fused_local_head(H, W, None, Y, config={"occupancy": 0.5}, backend=be),
     TypeError, "config must be a LaunchConfig"),
    ("target None", lambda be: fused_local_head(H, W, None, None, backend=be), TypeError,
     "target must be a torch.Tensor, got NoneType"),
    ("target None, LocalHead", lambda be: LocalHead(8, 3, backend=be)(H, None), TypeError,
     "target must be a torch.Tensor, got NoneType"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", LIBRARY, ids=[c[0] for c in LIBRARY])
def test_bad_head_input_names_the_argument_on_every_backend(case, backend):
    _, call, exc, message = case
    with pytest.raises(exc, match=message):
        call(backend)


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(reduction="none"), ValueError, "reduction must be"),
    (dict(bias=[1]), TypeError, "bias must be a bool"),
    (dict(occupancy=True), ValueError, "occupancy must be"),
    (dict(occupancy="half"), ValueError, "occupancy must be"),
    (dict(ignore_index=None), TypeError, "ignore_index must be an int"),
    (dict(backend="cuda"), ValueError, "backend must be"),
    (dict(out_features=65), ValueError, "supports 1 <= C <= 64"),
    (dict(out_features=0), ValueError, "out_features must be a positive int"),
    (dict(in_features=0), ValueError, "in_features must be a positive int"),
    (dict(loss="ce", out_features=1), ValueError, "supports 2 <= C"),
    (dict(final=1), TypeError, "final must be a bool"),
], ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={v[k]!r}" for k in v))
def test_bad_local_head_arguments_raise_at_construction(kwargs, exc, message):
    kw = {"in_features": 8, "out_features": 1, **kwargs}
    with pytest.raises(exc, match=message):
        LocalHead(**kw)


@pytest.mark.parametrize("blocks, message", [(torch.nn.Linear(8, 8), "got a single Linear"), (3, "got int"),
                                             ([torch.nn.Linear(8, 8), "x"], r"blocks\[1\] must be an nn.Module")])
def test_local_chain_names_a_bad_blocks_argument(blocks, message):
    with pytest.raises(TypeError, match=message):
        et.LocalChain(blocks, 8)


def test_bogus_mode_set_after_construction_raises_at_the_step():
    sched = Scheduler("erase")
    sched.mode = "bogus"
    with pytest.raises(ValueError, match="Scheduler.mode must be one of"):
        with sched.step():
            pass


def test_e2e_without_a_final_head_refuses_to_train_nothing():
    chain = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
    heads = torch.nn.ModuleList([LocalHead(8, 1, backend="torch"), LocalHead(8, 1, backend="torch")])
    x, y = torch.randn(4, 8), torch.rand(4).round()
    with pytest.raises(RuntimeError, match="none of them final"):
        with Scheduler("e2e").step():
            h = x
            for blk, hd in zip(chain, heads):
                h = hd(blk(h), y)
    # the same model trains in sequential mode, and with a final head in e2e
    with Scheduler("sequential").step():
        heads[1](chain[1](heads[0](chain[0](x), y)), y)
    heads[1].final = True
    with Scheduler("e2e").step():
        heads[1](chain[1](heads[0](chain[0](x), y)), y)
    assert chain[0].weight.grad is not None


def test_capture_rejects_bad_arguments_before_cuda():
    sched = Scheduler("erase")
    with pytest.raises(ValueError, match="warmup must be a positive int"):
        sched.capture(lambda: None, warmup=0)
    with pytest.raises(TypeError, match="step_fn must be callable"):
        sched.capture(None)


@pytest.mark.parametrize("loss, D", [("mse", 1000), ("bce", 1)])
def test_torch_backend_bf16_accumulates_in_fp32(loss, D):
    # the PyTorch backend computes as the kernels do (bf16 operands, fp32 sums), not in bf16
    torch.manual_seed(0)
    h, w, b = torch.randn(3, D), torch.randn(1, D) / D ** 0.5, torch.randn(1)
    y = torch.randn(3) if loss == "mse" else torch.rand(3).round()
    got = fused_local_head(h.bfloat16(), w.bfloat16(), b.bfloat16(), y, loss=loss, backend="torch")
    ref = reference.local_head(*(t.bfloat16().double() for t in (h, w, b)), y.double(), loss=loss)
    for name in ("loss", "grad_h", "grad_weight", "grad_bias"):
        g, r = getattr(got, name).double(), getattr(ref, name)
        assert ((g - r).norm() / r.norm()).item() < 1e-2, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_mse_with_large_residuals_stays_finite(backend):
    h = torch.full((4, 1), 1000.0).half()
    r = fused_local_head(h, torch.ones(1, 1).half(), None, torch.zeros(4), loss="mse", backend=backend)
    assert torch.isfinite(r.loss) and r.loss.item() == pytest.approx(1e6)


def test_metrics_are_nan_when_one_class_is_missing():
    logits = torch.randn(10)
    assert torch.isnan(normalized_entropy(logits, torch.zeros(10)))
    assert torch.isnan(auc(logits, torch.ones(10)))
    assert torch.isfinite(normalized_entropy(logits, torch.tensor([0.0, 1.0] * 5)))


def test_batches_refuse_a_non_positive_batch():
    from erase_triton.data import batches, synthetic_criteo
    data = synthetic_criteo(100, cardinality=10, seed=0)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            next(batches(data, bad, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("kw, message", [(dict(steps=0), "steps must be a positive int"),
                                         (dict(batch_size=-1), "batch_size must be a positive int")])
def test_train_functions_refuse_non_positive_sizes(kw, message):
    from erase_triton.train import train_ctr, train_transformer
    with pytest.raises(ValueError, match=message):
        train_ctr(data="synthetic", synthetic_rows=1000, progress=False, **kw)
    with pytest.raises(ValueError, match=message):
        train_transformer(progress=False, **kw)


# ------------------------------------------------------------------------------ data
ML_USER = "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n1\t24\tM\ttech\t85711\n"
ML_ITEM = "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n1\tToy Story\t1995\tComedy\n"
ML_HEAD = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"


def _ml(tmp_path, inter: str):
    (tmp_path / "ml-100k.user").write_text(ML_USER)
    (tmp_path / "ml-100k.item").write_text(ML_ITEM)
    (tmp_path / "ml-100k.inter").write_text(ML_HEAD + inter)
    return str(tmp_path)


GOOD = "".join(f"1\t1\t{r}\t{881250949 + i}\n" for i, r in enumerate([5, 1, 4, 2, 3] * 4))


def test_a_well_formed_movielens_folder_loads(tmp_path):
    tr, va, te = load_movielens(data_dir=_ml(tmp_path, GOOD))
    assert len(tr) + len(va) + len(te) == 20 and set(tr.label.tolist()) == {0.0, 1.0}


@pytest.mark.parametrize("inter, message", [
    (GOOD + "1\t1\t4\n", r"ml-100k.inter:22: expected 4 tab-separated fields"),          # a line cut mid-row
    (GOOD + "1\t1\tnan\t881250999\n", r"ml-100k.inter:22: rating must be a number in \[1, 5\]"),
    (GOOD + "1\t1\tabc\t881250999\n", r"ml-100k.inter:22: rating must be a number"),
    (GOOD + "1\t1\t4\t-3\n", r"ml-100k.inter:22: timestamp must be a number"),
    ("", r"ml-100k.inter: no data rows"),
    ("".join(f"1\t1\t1\t{i}\n" for i in range(10)), r"every rating gives the label 0"),
])
def test_a_corrupt_movielens_file_names_file_and_line(tmp_path, inter, message):
    with pytest.raises(DataError, match=message):
        load_movielens(data_dir=_ml(tmp_path, inter))


# ------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize("argv, message", [
    (["train", "--batch-size", "-1"], "expected a positive integer"),
    (["train", "--batch-size", "0"], "expected a positive integer"),
    (["train", "--steps", "0"], "expected a positive integer"),
    (["train", "--steps", "-5"], "expected a positive integer"),
    (["train", "--model", "transformer", "--steps", "-1"], "expected a positive integer"),
    (["train", "--steps", "x"], "expected a positive integer"),
    (["train", "--json", "/nonexistent-folder/r.json"], "does not exist"),
    (["train", "--plot", "/nonexistent-folder/r.png"], "does not exist"),
    (["train", "--json", "/"], "is a folder"),
    (["train", "--plot", "/"], "is a folder"),
    (["train", "--plot", "loss.txt"], "must end in a picture format"),
    (["train", "--plot", "loss"], "must end in a picture format"),
    (["train", "--model", "transformer", "--embedding", "fused_sgd"], "--embedding applies to --model ctr only"),
    (["train", "--model", "transformer", "--data", "synthetic", "--embedding", "table"],
     "--data and --embedding apply to --model ctr only"),
    (["plot", "/nonexistent-file.csv"], "is not a file"),
    (["plot", __file__, "--out", __file__], "is a file; give a folder"),
    (["trace", "--steps", "0"], "expected a positive integer"),
])
def test_cli_mistakes_are_one_error_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_cli_plot_of_a_non_csv_file(tmp_path, capsys):
    p = tmp_path / "x.csv"
    p.write_bytes(b"\x00\xff\xfe binary")
    with pytest.raises(SystemExit) as e:
        main(["plot", str(p)])
    assert e.value.code == 2 and "no plot drawn" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answers")
@pytest.mark.parametrize("argv, message", [(["trace"], "trace needs a CUDA device"),
                                           (["train", "--graph"], "--graph needs a CUDA device")])
def test_cli_cuda_only_commands_on_a_cpu(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answer")
def test_cli_backend_triton_on_a_cpu(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["train", "--backend", "triton"])
    assert e.value.code == 2 and "--backend triton needs a CUDA device" in capsys.readouterr().err


def test_launch_config_occupancy_type():
    for bad in ("0.5", True, [0.5], 0, 1.5):
        with pytest.raises(ValueError, match="occupancy must be a number"):
            et.LaunchConfig(occupancy=bad)


def test_ktests_resume_drops_the_first_selected_cases(tmp_path):
    # run_gpu_checks.sh's KTESTS_FROM: a second device call picks up after the cases the first one ran
    (tmp_path / "test_cases.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(6)))
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    env = dict(os.environ, PYTHONPATH=bench, KTESTS_FROM="2")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "pytest_skip_first",
                          "-k", "not test_1", "-v", str(tmp_path / "test_cases.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ran = re.findall(r"::(test_\d) PASSED", out.stdout)
    assert ran == ["test_3", "test_4", "test_5"], out.stdout  # test_0 and test_2: the first two selected
