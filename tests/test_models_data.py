"""Data loaders, metrics, the CTR and transformer models, and the CLI, on CPU."""
import importlib.util
import json
import os

import pytest
import torch

from erase_triton import Scheduler, metrics
from erase_triton.data import load_movielens, load_text, synthetic_criteo
from erase_triton.data import movielens as ml
from erase_triton.data import text as textmod
from erase_triton.models import CTRConfig, CTRModel, TinyTransformer

HAVE_RECBOLE = importlib.util.find_spec("recbole") is not None
RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")


# -------------------------------------------------------------------- metrics
def test_ne_of_base_rate_prediction_is_one():
    y = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1])
    p = y.mean()
    logits = torch.full_like(y, torch.logit(p).item())
    assert metrics.normalized_entropy(logits, y).item() == pytest.approx(1.0, abs=1e-9)


def test_auc_matches_pair_count_with_ties():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 5, (200,), generator=g).float()  # many ties
    y = torch.rand(200, generator=g).round()
    pos, neg = s[y == 1], s[y == 0]
    pairs = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    assert metrics.auc(s, y).item() == pytest.approx(pairs.mean().item(), abs=1e-12)
    assert metrics.auc(y, y).item() == pytest.approx(1.0)


# ----------------------------------------------------------------------- data
@pytest.mark.skipif(not HAVE_RECBOLE, reason="recbole not installed")
def test_movielens_split_and_fields():
    tr, va, te = load_movielens()
    assert (len(tr), len(va), len(te)) == (80000, 10000, 10000)
    assert tr.sparse.shape[1] == len(tr.cardinalities) == 7
    assert set(tr.label.unique().tolist()) == {0.0, 1.0}
    for i, c in enumerate(tr.cardinalities):
        assert int(tr.sparse[:, i].max()) < c
    assert 0.4 < tr.label.mean().item() < 0.7


def test_movielens_missing_package_names_the_install(monkeypatch):
    monkeypatch.setattr(ml.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install --no-deps recbole==1\.2\.1"):
        load_movielens()


def test_synthetic_is_seeded_and_power_law():
    a = synthetic_criteo(5000, cardinality=1000, seed=3)
    b = synthetic_criteo(5000, cardinality=1000, seed=3)
    assert torch.equal(a.sparse, b.sparse) and torch.equal(a.label, b.label)
    assert a.dense.shape == (5000, 13) and a.sparse.shape == (5000, 26)
    assert 0.2 < a.label.mean().item() < 0.3
    counts = torch.bincount(a.sparse[:, 0], minlength=1000).sort(descending=True).values
    assert counts[:10].sum() > 5 * counts[-500:].sum()  # heavy head, long tail


def test_text_sources(monkeypatch, tmp_path):
    tr, va = load_text("pydoc")
    assert len(tr) > 100_000 and len(va) > 1000 and tr.dtype == torch.uint8
    monkeypatch.setattr(textmod, "FORTUNES", str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="apt-get install fortunes"):
        load_text("fortunes")


# --------------------------------------------------------------------- models
def tiny_ctr(backend):
    torch.manual_seed(0)
    return CTRModel(CTRConfig(n_dense=5, cardinalities=[11, 7, 13], emb_dim=8, width=32, depth=1, backend=backend))


def ctr_batch(n=48):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 5, generator=g), torch.stack([torch.randint(0, c, (n,), generator=g) for c in (11, 7, 13)], 1),
            torch.rand(n, generator=g).round())


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_ctr_erase_equals_sequential(backend, monkeypatch):
    # sequential and erase (on fake CUDA streams: the ring path a GPU runs, forks included) give the
    # gradients of the CTR model with PyTorch heads; e2e trains only the final head and the embeddings
    from fake_cuda import fake_cuda

    batch = ctr_batch()
    ref = tiny_ctr("torch")
    with Scheduler("sequential").step():
        ref(*batch)
    want = {k: p.grad.clone() for k, p in ref.named_parameters() if p.grad is not None}
    model = tiny_ctr(backend)
    grads = {}
    for mode in ("sequential", "erase", "e2e"):
        model.zero_grad(set_to_none=True)
        if mode == "erase":
            fake_cuda(monkeypatch, lambda name: True)
        sched = Scheduler(mode, adaptive=False)
        with sched.step():
            model(*batch)
        monkeypatch.undo()
        if mode == "erase":
            assert sched.last_forks == len(model.heads), sched.last_trace
        grads[mode] = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    for mode in ("sequential", "erase"):
        assert grads[mode].keys() == want.keys()
        for k in want:  # the Triton heads (interpreter) against PyTorch heads: fp32 rounding apart
            torch.testing.assert_close(grads[mode][k], want[k], rtol=1e-4, atol=1e-6, msg=f"{mode} {k}")
    # e2e: only the final head is active, and the embeddings still learn through it
    assert not any(k.startswith("heads.") for k in grads["e2e"])
    assert "embeddings.0.weight" in grads["e2e"]
    assert model.predict(*batch[:2]).shape == (48,)


def assert_modes_match(model, inputs, ref, want):
    """erase == sequential == `want` (the grads of a detached reference written by hand on `ref`, a
    copy of `model`), and e2e == plain autograd through every block (e2e_loss_fn on `ref`)."""
    from erase_triton.bench import e2e_loss_fn

    def grads(mode):
        model.zero_grad(set_to_none=True)
        with Scheduler(mode).step():
            model(*inputs)
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    for mode in ("sequential", "erase"):
        got = grads(mode)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    got = grads("e2e")
    ref.zero_grad(set_to_none=True)
    e2e_loss_fn(ref)(*inputs).backward()
    for k, p in ref.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[k], p.grad, rtol=1e-5, atol=1e-6, msg=k)


def test_ctr_head_every():
    # head_every=3: two segments of three subarchitectures, then the over-arch and the final head;
    # erase == sequential == a detached reference written by hand, e2e == plain autograd
    import copy

    import torch.nn.functional as F
    torch.manual_seed(0)
    model = CTRModel(CTRConfig(n_dense=5, cardinalities=[11, 7, 13], emb_dim=8, width=32, depth=1, backend="torch",
                               head_every=3))
    assert len(model.heads) == 2 and len(model.subarchs) == 6
    batch = ctr_batch()
    dense, sparse, label = batch
    ref = copy.deepcopy(model)
    h = ref.features(dense, sparse)
    for i, head in enumerate(ref.heads):
        for sub in ref.subarchs[3 * i:3 * i + 3]:
            h = sub(h)
        F.binary_cross_entropy_with_logits(head.logits(h).squeeze(-1), label).backward()
        h = h.detach()
    F.binary_cross_entropy_with_logits(ref.final_head.logits(ref.over(h)).squeeze(-1), label).backward()
    assert_modes_match(model, batch, ref, {k: p.grad.clone() for k, p in ref.named_parameters() if p.grad is not None})
    for bad in (4, 0, True, 1.0):
        with pytest.raises(ValueError, match="head_every must be a positive int dividing n_subarch=6"):
            CTRModel(CTRConfig(n_dense=5, cardinalities=[3], head_every=bad))


def test_ctr_fused_and_torch_heads_agree():
    a, b = tiny_ctr("auto"), tiny_ctr("torch")
    batch = ctr_batch()
    for m in (a, b):
        with Scheduler("erase").step():
            m(*batch)
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("mode", ["e2e", "sequential", "erase"])
def test_fused_sgd_embeddings_equal_tables_then_sgd(mode):
    # The fused in-backward update equals per-table dense gradients followed by SGD.step,
    # and every other parameter's gradient is unchanged by the fused tables.
    cards = [11, 7, 13]
    lr = 0.3
    torch.manual_seed(0)
    ref = CTRModel(CTRConfig(n_dense=5, cardinalities=cards, emb_dim=8, width=32, depth=1, backend="torch"))
    torch.manual_seed(0)
    fused = CTRModel(CTRConfig(n_dense=5, cardinalities=cards, emb_dim=8, width=32, depth=1, backend="torch",
                               embedding="fused_sgd", embedding_lr=lr))
    with torch.no_grad():
        fused.embeddings.weight.copy_(torch.cat([e.weight for e in ref.embeddings]))
    fused.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("embeddings.")}, strict=False)
    dense, sparse, label = ctr_batch()
    sparse[:5, 0] = 3  # duplicate ids: their gradients must add up
    for m in (ref, fused):
        with Scheduler(mode).step():
            m(dense, sparse, label)
    assert fused.embeddings.weight.grad is None
    with torch.no_grad():
        stepped = torch.cat([e.weight - lr * e.weight.grad for e in ref.embeddings])
    torch.testing.assert_close(fused.embeddings.weight.detach(), stepped, rtol=1e-6, atol=1e-7)
    for (k, pr), pf in zip(((k, p) for k, p in ref.named_parameters() if not k.startswith("embeddings.")),
                           (p for k, p in fused.named_parameters() if not k.startswith("embeddings."))):
        if pr.grad is None:
            assert pf.grad is None, k
        else:
            torch.testing.assert_close(pf.grad, pr.grad, rtol=1e-5, atol=1e-7, msg=k)
    fused.embeddings.set_lr(0.0)  # a buffer: reaches captured graphs too
    before = fused.embeddings.weight.detach().clone()
    with Scheduler(mode).step():
        fused(dense, sparse, label)
    torch.testing.assert_close(fused.embeddings.weight.detach(), before, rtol=0, atol=0)
    assert fused.predict(dense, sparse).shape == (48,)


def test_fused_sgd_embeddings_reject_bad_input():
    from erase_triton.models.embedding import FusedSGDEmbeddings

    with pytest.raises(ValueError, match="cardinalities must be a non-empty list"):
        FusedSGDEmbeddings([], 4)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        FusedSGDEmbeddings([5], 4, lr=-1.0)
    emb = FusedSGDEmbeddings([5, 3], 4)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        emb.set_lr(float("nan"))
    with pytest.raises(ValueError, match=r"ids must be \[B, 2\] field ids"):
        emb(torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids\[:, 1\] must be in \[0, 3\)"):
        emb(torch.tensor([[4, 3]]))
    with pytest.raises(ValueError, match=r"ids\[:, 0\] must be in \[0, 5\)"):
        emb(torch.tensor([[-1, 0]]))
    emb.eval()
    out = emb(torch.tensor([[4, 2]]))  # eval: a plain lookup, no update in backward
    torch.testing.assert_close(out[0], emb.weight[[4, 7]].detach())


def test_ctr_rejects_bad_embedding_kind():
    with pytest.raises(ValueError, match="embedding must be 'table' or 'fused_sgd'"):
        CTRModel(CTRConfig(n_dense=5, cardinalities=[3], embedding="sparse"))


def test_ctr_rejects_wrong_field_count():
    with pytest.raises(ValueError, match=r"sparse must be \[B, 3\]"):
        tiny_ctr("torch")(torch.randn(4, 5), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4))


def test_transformer_modes():
    torch.manual_seed(0)
    m = TinyTransformer(vocab=256, width=32, layers=6, n_heads=2, max_seq=16, backend="torch")
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    for mode in ("e2e", "sequential", "erase"):
        m.zero_grad(set_to_none=True)
        with Scheduler(mode).step():
            m(x, y)
        assert torch.isfinite(m.heads[-1].last_loss)
    assert m.logits(x).shape == (2, 16, 256)
    with pytest.raises(ValueError, match="max_seq"):
        m.embed(torch.zeros(1, 17, dtype=torch.long))


def test_transformer_head_every():
    # head_every=2: three segments of two layers; erase == sequential == the detached reference
    # written by hand, and e2e == plain autograd through all six layers (e2e_loss_fn)
    import copy

    import torch.nn.functional as F
    torch.manual_seed(0)
    m = TinyTransformer(vocab=64, width=32, layers=6, n_heads=2, max_seq=8, head_every=2, backend="torch")
    assert len(m.heads) == 3 and [h.final for h in m.heads] == [False, False, True]
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    ref = copy.deepcopy(m)
    h = ref.embed(x)
    for i, head in enumerate(ref.heads):
        h = ref.layers[2 * i + 1](ref.layers[2 * i](h))
        out = ref.ln_f(h) if i == 2 else h
        F.cross_entropy(head.logits(out).reshape(-1, 64), y.reshape(-1)).backward()
        h = h.detach()
    assert_modes_match(m, (x, y), ref, {k: p.grad.clone() for k, p in ref.named_parameters() if p.grad is not None})
    with pytest.raises(ValueError, match="head_every must be a positive int dividing layers=6"):
        TinyTransformer(layers=6, head_every=4)


@pytest.mark.parametrize("path", ["recompute", "vocab_chunks", "row_chunks", "cublas", "cublas_vocab_chunks"])
def test_transformer_with_a_vocabulary_head_matches_the_torch_backend(path):
    # 600 classes: every head on a vocabulary CE kernel (set_vocab_path picks which), one erase step
    # against the same model on the PyTorch backend
    import copy

    import erase_triton.kernels.plan as klh
    from erase_triton.bench import set_vocab_path
    klh._PLANS.clear()
    torch.manual_seed(0)
    m = TinyTransformer(vocab=600, width=32, layers=6, n_heads=2, max_seq=8, head_every=3, backend="triton")
    ref = copy.deepcopy(m)
    for hd in ref.heads:
        hd.backend = "torch"
    set_vocab_path(m, path)
    x, y = torch.randint(0, 600, (2, 8)), torch.randint(0, 600, (2, 8))
    for model in (m, ref):
        with Scheduler("erase").step():
            model(x, y)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda s, n=name: f"{n}: {s}")
    assert {p.kind for p in klh._PLANS.values()} == {"vocab" if path == "recompute" else path}


# ------------------------------------------------------------------------ CLI
@pytest.mark.skipif(not HAVE_RECBOLE, reason="recbole not installed")
def test_cli_train_ctr_writes_summary(tmp_path, capsys):
    from erase_triton.cli import main

    out = tmp_path / "r.json"
    main(["train", "--steps", "20", "--batch-size", "256", "--backend", "torch", "--head-every", "2", "--json", str(out)])
    r = json.loads(out.read_text())
    for k in ("ne", "auc", "examples_per_s", "peak_memory_mb"):
        assert k in r
    assert 0.0 < r["ne"] < 2.0 and 0.0 <= r["auc"] <= 1.0 and r["examples_per_s"] > 0 and r["head_every"] == 2
    printed = capsys.readouterr().out
    assert "test NE" in printed and "head_every=2" in printed


def test_cli_train_transformer(tmp_path):
    from erase_triton import train

    r = train.train_transformer(steps=3, batch_size=2, width=32, seq=16, backend="torch", progress=False)
    assert r["perplexity"] > 1 and r["examples_per_s"] > 0
    r = train.train_transformer(steps=2, batch_size=2, width=32, seq=16, backend="torch", progress=False, head_every=3)
    assert r["head_every"] == 3 and r["perplexity"] > 1


def test_cli_graph_needs_cuda():
    from erase_triton.cli import main

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(SystemExit) as e:
        main(["train", "--graph"])
    assert e.value.code == 2


@pytest.mark.skipif(not os.path.isdir(RESULTS), reason="no committed results")
def test_plot_committed_results(tmp_path):
    from erase_triton.cli import main

    plotted = ("compile", "compile_head_every", "early_update", "early_update_compiled", "local_head",
               "quality_ctr_summary", "quality_lm_summary", "schedule_eager_wall_summary", "schedule_grid_summary",
               "speedup_curves", "sweep")  # the committed figures under benchmarks/plots/
    csvs = [os.path.join(RESULTS, f + ".csv") for f in plotted]
    assert csvs
    main(["plot", *csvs, "--out", str(tmp_path)])
    for c in csvs:
        png = tmp_path / (os.path.splitext(os.path.basename(c))[0] + ".png")
        assert png.stat().st_size > 10_000


def test_compile_rows_keep_a_failing_baseline(monkeypatch):
    """The torch.compile rows: e2e compiled whole (host-issued, then graphed), then sequential and
    erase with compiled blocks (graphed), one row each; one that fails leaves a row with its error
    instead of losing the study."""
    from erase_triton.bench import studies as study

    calls = []

    def fake_e2e(model, inputs, graphed=False):
        calls.append(("e2e", graphed))
        if graphed:
            raise RuntimeError("capture failed")
        return {"ms": 1.5}

    def fake_step(model, inputs, mode, graphed, compiled=False, early_update=False):
        calls.append((mode, graphed, compiled) + (("early",) if early_update else ()))
        return {"ms": 0.9 if early_update else 1.0 if mode == "erase" else 1.25}
    monkeypatch.setattr(study, "time_compiled_e2e", fake_e2e)
    monkeypatch.setattr(study, "time_step", fake_step)
    name, desc, build = study.bench_cases(models=("ctr",))[0]
    rows = study.compile_rows(name, desc, build, log=lambda r: None)
    assert calls == [("e2e", False), ("e2e", True), ("sequential", True, True), ("erase", True, True)]
    assert [(r["exec"], r["mode"]) for r in rows] == [("compile", "e2e"), ("compile+graph", "e2e"),
                                                      ("compile+graph", "sequential"), ("compile+graph", "erase")]
    assert rows[0]["ms"] == 1.5 and "ms" not in rows[1] and [r["ms"] for r in rows[2:]] == [1.25, 1.0]
    assert "capture failed" in rows[1]["error"] and rows[1]["width"] == desc["width"]
    calls.clear()
    rows = study.compile_rows(name, desc, build, log=lambda r: None, modes=("erase",))
    assert calls == [("erase", True, True)] and len(rows) == 1
    calls.clear()  # early updates: one more erase row, marked
    rows = study.compile_rows(name, desc, build, log=lambda r: None, modes=("erase",), early_update=True)
    assert calls == [("erase", True, True), ("erase", True, True, "early")]
    assert [r.get("early_update") for r in rows] == [None, 1] and rows[1]["ms"] == 0.9


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_graphed_compile_baseline_needs_cuda():
    from erase_triton.bench import studies as study

    name, desc, build = study.bench_cases(models=("ctr",))[0]
    model, inputs = build()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        study.time_compiled_e2e(model, inputs, graphed=True)


def test_bench_cases_head_every():
    # head_every reaches both models' builds and their size dicts (bench_compile --head-every)
    from erase_triton.bench import studies as study

    cases = study.bench_cases(head_every=3)
    assert {name for name, *_ in cases} == {"ctr", "transformer"}
    for name, desc, build in cases:
        model, _ = build()
        assert desc["head_every"] == 3 and len(model.heads) == 2, name
    assert all("head_every" not in desc for _, desc, _ in study.bench_cases())


def test_bench_quality_rebuilds_summary_from_runs(tmp_path):
    # --from-csv: the summary of a per-run CSV (mean, std, change against e2e) without training
    import subprocess
    import sys

    from erase_triton.bench import read_csv, write_csv
    runs = tmp_path / "q.csv"
    write_csv(str(runs), [dict(model="transformer_k2", mode=m, seed=s, perplexity=p)
                          for m, s, p in [("e2e", 0, 3.0), ("e2e", 1, 3.2), ("erase", 0, 3.3), ("erase", 1, 3.3)]],
              dict(gpu="test", torch="t", triton="t"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_quality.py"), "--from-csv", str(runs)],
                   check=True, capture_output=True)
    got = {r["mode"]: r for r in read_csv(str(tmp_path / "q_summary.csv"))}
    assert got.keys() == {"e2e", "erase"} and got["e2e"]["runs"] == "2" and got["erase"]["gpu"] == "test"
    assert float(got["e2e"]["perplexity_mean"]) == pytest.approx(3.1)
    assert float(got["e2e"]["perplexity_std"]) == pytest.approx(0.1414, abs=1e-4)
    assert float(got["erase"]["rel_to_e2e_pct"]) == pytest.approx(100 * (3.3 / 3.1 - 1))
    assert (tmp_path / "q_summary.png").exists()


@pytest.mark.parametrize("script, args, message", [
    ("bench_compile.py", ["--head-every", "2,4"], "--head-every: expected 1, 2, 3 or 6"),
    ("bench_compile.py", ["--head-every", "x"], "--head-every: expected 1, 2, 3 or 6"),
    ("bench_compile.py", ["--beside", "1.5"], "--beside: expected fractions in (0, 1]"),
    ("bench_data_parallel.py", ["--out", "x.csv", "--widths", "a"], "--widths: expected integers"),
    ("bench_data_parallel.py", ["--out", "x.csv", "--models", "gpt"], "--models takes mlp and/or ctr"),
    ("bench_data_parallel.py", ["--out", "x.csv"], "run it under torchrun"),
    ("check_reliability.py", ["soak", "--steps", "150"], "--steps: expected a positive multiple of 100"),
    ("bench_local_head.py", ["--vocab", "--shapes", "4096:512"], "--shapes: expected N:D:V"),
    ("bench_vocab_rounds.py", ["--shape", "4096:512"], "--shape N:D:V, --chunks A,B,... and --vocab-chunks"),
    ("bench_vocab_rounds.py", ["--chunks", "1024,x"], "--shape N:D:V, --chunks A,B,... and --vocab-chunks"),
    ("bench_vocab_rounds.py", ["--vocab-chunks", "0"], "--vocab-chunks A,B,...: expected positive integers"),
    ("bench_vocab_rounds.py", ["--paths", "cublas,lean"], "--paths: expected some of recompute"),
    ("bench_vocab_rounds.py", ["--lt-gemms", "logits,dz"], "--lt-gemms: expected some of logits, grad_weight"),
    ("bench_vocab_rounds.py", ["--dz-stages", "2,-1"], "--dz-stages: expected non-negative integers"),
    ("bench_vocab_rounds.py", ["--dz-tiles", "64x128"], "--dz-tiles: expected tiles as ROWSxCOLUMNSxWARPS"),
    ("bench_vocab_rounds.py", ["--dz-band-tiles", "8x0x4"], "--dz-band-tiles: expected tiles as ROWSxCOLUMNS"),
    ("bench_vocab_rounds.py", ["--kernels", "-1"], "--kernels: expected a non-negative integer"),
    ("bench_vocab_accuracy.py", ["--shape", "64:32:256"], "--shape N:D:V (V > 512, a vocabulary head)"),
    ("bench_vocab_accuracy.py", ["--paths", "lean"], "--paths: expected some of recompute")])
def test_benchmark_scripts_reject_bad_arguments(script, args, message, monkeypatch, capsys):
    # checked before the CUDA check, so a CPU machine tells a user what is wrong with the command. Run as
    # __main__ in this process (runpy): a Python start and torch import a case cost CI a minute in all
    import runpy
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", script)
    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the scripts put their own directory first)
    with pytest.raises(SystemExit) as ex:
        runpy.run_path(path, run_name="__main__")
    err = capsys.readouterr().err + str(ex.value.code)  # (argparse prints; sys.exit(msg) carries it)
    assert ex.value.code not in (0, None) and message in err, err[-500:]


def test_vocab_rounds_kernel_table_is_per_call(monkeypatch):
    # --kernels' breakdown: each kernel's time and launches a call (n calls' events), their sum in ms
    import runpy
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # (the script puts its own directory first)
    kernel_table = runpy.run_path(os.path.join(os.path.dirname(RESULTS), "bench_vocab_rounds.py"))["kernel_table"]
    ms, per = kernel_table([("gemm", 30.0), ("dz", 12.0), ("gemm", 30.0), ("dz", 14.0), ("memset", 1.0)], 2)
    assert per == {"gemm": [30.0, 1.0], "dz": [13.0, 1.0], "memset": [0.5, 0.5]}
    assert ms == pytest.approx(0.0435)


def test_vocab_accuracy_study_runs_on_the_cpu(tmp_path):
    # the study a CPU can run (kernels in the interpreter): every row's errors against float64, and each over eager's
    import subprocess
    import sys

    from erase_triton.bench import read_csv

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "acc.csv"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_vocab_accuracy.py"), "--shape",
                        "96:32:600", "--chunks", "64", "--out", str(out)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-800:]
    rows = {row["variant"]: row for row in read_csv(str(out))}
    assert list(rows) == ["torch", "one rounding", "cublas", "cublas_vocab_chunks", "cublas chunk_size=64"]
    for name, row in rows.items():
        for what in ("loss", "grad_h", "grad_W", "grad_b"):
            err = float(row[what])
            assert 0 <= err < 0.02, (name, what, err)  # bf16: a few 1e-3
            assert float(row[f"{what}_over_torch"]) == pytest.approx(err / float(rows["torch"][what]))
