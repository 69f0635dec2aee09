"""Evaluation through pipeline stages (CPU, gloo): a probe's logits through 2 stages equal the whole model's, the
accuracies of the two agree, and each sample counts once (on the last stage of its data-parallel replica)."""
import torch
import torch.nn.functional as F

from tests.support.in_process import run_processes
from tests.support.train_run import SMALL

PROBES = ["data.seq_len=192", "train.eval.probe_examples=3", "train.eval.probe_lens=[160,192,384]",
          "train.eval.mqar_pairs=2", "train.eval.mqar_queries=1"]


def _worker(rank: int, stages: int, out: str):
    torch.set_num_threads(1)
    from tests.support.pipeline_harness import job_of
    from train.evaluation.evaluate import Evaluator
    from train.run.engine import build_engine

    job = job_of(SMALL + PROBES + [f"parallel.pipeline_stages={stages}", "train.grad_accum_steps=2",
                                   f"parallel.cuts={[8] if stages > 1 else 'null'}"])
    engine = build_engine(job)
    evaluator = Evaluator(job, engine)
    samples = evaluator.probes["passkey", 160][:2]
    ids, docs = torch.stack([s.input_ids for s in samples]), torch.stack([s.doc_ids for s in samples])
    logits_of = evaluator.pipeline_logits if stages > 1 else evaluator.whole_model_logits

    def oracle(ids, docs):  # predicts every next token right, where logits_of has logits at all
        return None if logits_of(ids, docs) is None else F.one_hot(ids.roll(-1, 1), job.args.vocab_size).float()
    torch.save({"logits": logits_of(ids, docs), "row": evaluator(probes=True),
                "perfect": evaluator.probe_accuracy(oracle),
                "lengths": sorted({length for _, length in evaluator.probes})}, f"{out}/rank{rank}.pt")


def _run(tmp_path, stages: int) -> list[dict]:
    out = tmp_path / f"p{stages}"
    out.mkdir()
    run_processes(_worker, stages, stages, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(stages)]


def test_pipelined_probes_equal_the_whole_model(tmp_path):
    (whole,), (first, last) = _run(tmp_path, 1), _run(tmp_path, 2)
    assert whole["lengths"] == [160, 192, 384]
    assert first["lengths"] == last["lengths"] == [160, 192]  # 384 > data.seq_len: skipped through the stages
    assert first["logits"] is None
    want = whole["logits"]
    assert ((last["logits"] - want).norm() / want.norm()).item() < 1e-5  # padded to seq_len: other GEMM shapes
    assert first["row"] == last["row"]
    for key, value in last["row"].items():
        if "loss" in key:  # held-out loss parts, as the whole model's evaluation names them
            assert abs(value - whole["row"][key]) <= 1e-5 * abs(whole["row"][key]) + 1e-7, key
        else:
            assert value == whole["row"][key], key
    assert {"loss", "lm_loss", "indexer_loss"} <= last["row"].keys()
    for row in (whole["perfect"], first["perfect"], last["perfect"]):  # each sample counted exactly once
        assert row and all(value == 1.0 for value in row.values()), row
