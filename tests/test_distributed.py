"""erase_triton.distributed on CPUs: two gloo ranks, different data, 3 steps, every mode.

Each rank's gradients and parameters must equal the single-process run on the union batch
(the ranks' rows together), at every step; a whole-model DDP must be refused."""
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dp_cases  # noqa: E402

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run tests/dp_cases.py as two gloo ranks once; returns each rank's saved results."""
    return dp_cases.run_ranks(WORLD, str(tmp_path_factory.mktemp("dp") / "out"))


@pytest.mark.parametrize("case", list(dp_cases.CASES))
def test_ranks_equal_the_union_batch_every_step(ranks, case):
    ref = dp_cases.train(case, lambda s: dp_cases.union(case, s, WORLD), dp=False)
    for step, (grads, params) in enumerate(ref):
        for r in range(WORLD):
            g_r, p_r = ranks[r][case][step]
            assert g_r.keys() == grads.keys(), (case, step, r)
            for k in grads:
                torch.testing.assert_close(g_r[k], grads[k], rtol=1e-5, atol=1e-6, msg=f"{case} step {step} rank {r} grad {k}")
            for k in params:
                torch.testing.assert_close(p_r[k], params[k], rtol=1e-5, atol=1e-6, msg=f"{case} step {step} rank {r} {k}")


def test_whole_model_ddp_or_fsdp_is_refused(ranks):
    for r in range(WORLD):
        found = ranks[r]["refusals"]
        assert "erase_triton.distributed.data_parallel" in found["ddp_forward"], found
        assert "DistributedDataParallel" in found["ddp_wrap"], found
        assert "erase_triton.distributed.data_parallel" in found["fsdp_forward"], found
        assert "sharded by FSDP" in found["fsdp_wrap"], found


def test_data_parallel_needs_a_process_group():
    from erase_triton.distributed import data_parallel, shard_of

    with pytest.raises(RuntimeError, match="init_process_group"):
        data_parallel(dp_cases.build("mlp"))
    assert [shard_of(7, r, 3) for r in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]


def test_torchrun_trains_the_ctr_model_data_parallel(tmp_path):
    # `torchrun --nproc_per_node 2 erase-triton train`: each rank its shard, rank 0 prints and writes
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
                        "-m", "erase_triton.cli", "train", "--steps", "6", "--batch-size", "64",
                        "--embedding", "fused_sgd", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("test NE") == 1 and "ranks=2" in r.stdout, r.stdout
    import json
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and len(res["train_loss"]) == 6


def test_bench_data_parallel_summary(tmp_path):
    # benchmarks/bench_data_parallel.py --summary: scaling per mode and erase over e2e at N against 1
    from erase_triton.bench import read_csv, write_csv

    def rows(world, rates):
        return [dict(model="ctr", width=2048, batch=16384, exec="graph", mode=m, world_size=world, examples_per_s=r)
                for m, r in zip(("e2e", "sequential", "erase"), rates)]
    write_csv(str(tmp_path / "dp_1.csv"), rows(1, [100.0, 110.0, 120.0]))
    write_csv(str(tmp_path / "dp_2.csv"), rows(2, [190.0, 215.0, 240.0]))
    root = os.path.dirname(HERE)
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_data_parallel.py"), "--summary",
                        str(tmp_path / "dp_1.csv"), str(tmp_path / "dp_2.csv"), "--out", str(tmp_path / "s.csv")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (s,) = read_csv(str(tmp_path / "s.csv"))
    assert float(s["scaling_erase"]) == pytest.approx(2.0) and float(s["scaling_e2e"]) == pytest.approx(1.9)
    assert float(s["erase_over_e2e_1"]) == pytest.approx(1.2)
    assert float(s["change"]) == pytest.approx(240 / 190 - 1.2)


@pytest.fixture
def world_of_one():
    """A one-rank gloo process group in this process (unless one exists), torn down after the test."""
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if own:
        dist.destroy_process_group()


def test_sharded_at_world_size_one_equals_the_plain_run(world_of_one):
    # one rank: FSDP's full_tensor() is then the parameter's own storage (the harness clones it; without
    # that, every recorded step showed the last step's parameters, which once looked like a CUDA bug)
    for case in ("mlp-erase-sharded", "mlp-erase-early-sharded", "transformer-sequential-sharded"):
        ref = dp_cases.train(case, lambda s, c=case: dp_cases.batch(c, s, 0), dp=False)
        got = dp_cases.train(case, lambda s, c=case: dp_cases.batch(c, s, 0), dp=True)
        for step, ((g0, p0), (g1, p1)) in enumerate(zip(ref, got)):
            assert g1.keys() == g0.keys(), (case, step)
            for k in p0:
                torch.testing.assert_close(p1[k], p0[k], rtol=1e-5, atol=1e-6, msg=f"{case} step {step} {k}")
            for k in g0:
                torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-6, msg=f"{case} step {step} grad {k}")


def test_capture_of_a_sharded_model_is_refused(monkeypatch, world_of_one):
    # FSDP's gathers and frees run in Python hooks, which a graph replay skips: refused before any collective
    from fake_cuda import fake_cuda, fake_graphs

    from erase_triton import Scheduler
    from erase_triton.distributed import data_parallel

    model = data_parallel(dp_cases.build("mlp"), shard=True)
    x, y = dp_cases.batch("mlp", 0, 0)
    with Scheduler("erase").step():  # eager: fine
        model(x, y)
    fake_graphs(monkeypatch, fake_cuda(monkeypatch, lambda name: True))
    sched = Scheduler("erase")
    with pytest.raises(NotImplementedError, match=r"shard=True.*run sharded steps eagerly"):
        sched.capture(lambda a, b: model(a, b), x, y, warmup=1)
    monkeypatch.undo()
    assert not sched._capture_owns_step
    with Scheduler("erase").step():  # the model still trains eagerly
        model(x, y)


def test_sparse_gradients_are_refused(world_of_one):
    # a sparse embedding gradient would reach the flat all-reduce mid-step: refused by data_parallel, and by
    # the all-reduce itself for any other module that makes one
    from erase_triton.distributed import DataParallelGroup, all_reduce_grads, data_parallel

    model = dp_cases.build("mlp")
    model.emb = torch.nn.Embedding(10, 4, sparse=True)
    with pytest.raises(ValueError, match=r"model\.emb \(Embedding\) has sparse=True.*FusedSGDEmbeddings"):
        data_parallel(model)
    model.emb = torch.nn.EmbeddingBag(10, 4, sparse=True)
    with pytest.raises(ValueError, match=r"model\.emb \(EmbeddingBag\) has sparse=True"):
        data_parallel(model)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    dense = torch.nn.Parameter(torch.ones(3))
    dense.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"shape \(10, 4\) has a torch.sparse_coo gradient"):
        all_reduce_grads([dense, emb.weight], DataParallelGroup(None, 1, 0))
    assert all_reduce_grads([dense], DataParallelGroup(None, 1, 0)) == 1


def test_a_cpu_model_under_nccl_is_refused(world_of_one, monkeypatch):
    # NCCL would fail inside the broadcast with "No backend type associated with device type cpu"
    import torch.distributed as dist

    from erase_triton.distributed import data_parallel

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match=r"model\.blocks\.0\.0\.weight is on cpu but the process group is NCCL"):
        data_parallel(dp_cases.build("mlp"))
