"""``python -m train.generate`` on a tiny checkpoint trained here: greedy decoding is deterministic and equals a
greedy loop over the model's logits written below; the export generates the same; sampling is seeded, and a
nucleus of one token is greedy; ``--chat`` prompts as training formatted conversations. The training run's header
also prints the sizes of its training and held-out sets, checked against the documents written here."""
import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from model import ModelArgs, Transformer, layout_from_config
from tests.support.cli import run_module
from train.data.sft import ChatEncoder
from train.data.tokenizer import ByteTokenizer
from train.export import export
from train.formats import checkpoint
from train.generate import generate, load, prompt_tokens

REPO = Path(__file__).resolve().parents[2]
TEXTS = [f"the {animal} sat on the {thing} number {i}." for i, (animal, thing) in
         enumerate((a, t) for a in ("cat", "dog", "owl", "fox") for t in ("mat", "log", "rug", "box", "hat"))]
ENV = {k: v for k, v in os.environ.items() if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                         "MASTER_PORT"}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    data = root / "animals.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    run_dir = root / "run"
    done = subprocess.run([sys.executable, "-m", "train", "data=hf", f"data.path={data}", "data.seq_len=64",
                           "data.micro_batch_size=2", "data.heldout_fraction=0.2", "train.max_steps=8",
                           "train.warmup_steps=2", "train.eval.batches=2", "train.eval.probe_examples=0",
                           "train.progress=false", "logger.mode=disabled", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=REPO, env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir / "checkpoints", done.stdout


def test_the_header_prints_the_set_sizes(trained):
    """Training and held-out documents add up to the file's, and so do their tokens: each text's UTF-8 bytes plus
    BOS/EOS make len + 1 next-token predictions."""
    _, stdout = trained
    line = next(line for line in stdout.splitlines() if "data: training set " in line)
    numbers = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) (?:documents|tokens)", line)]
    train_docs, train_tokens, held_docs, held_tokens = numbers
    assert train_docs + held_docs == len(TEXTS) and held_docs >= 1
    assert train_tokens + held_tokens == sum(len(t.encode()) + 1 for t in TEXTS)
    assert "(8 steps read 1,024 positions of it: " in line and "an evaluation reads 256 positions" in line


def greedy_reference(ckpt: Path, prompt: str, steps: int) -> str:
    """The weights put into a model built from the checkpoint's config; at each step the argmax of the last
    position's logits over the byte tokenizer's ids other than BOS and PAD, until EOS."""
    ref = checkpoint.locate(str(ckpt), "checkpoint")
    config = checkpoint.read_trainer_state(ref)["config"]
    model = Transformer(ModelArgs.from_config(config["model"]), layout_from_config(config["layout"]))
    model.load_state_dict(dict(checkpoint.read_weights(ref)))
    model.eval()
    tok = ByteTokenizer()
    ids = [tok.bos_id, *prompt.encode()]
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            logits[[tok.bos_id, tok.pad_id]] = -np.inf
            token = int(logits.argmax())
            if token == tok.eos_id:
                break
            out.append(token)
            ids.append(token)
    return tok.decode(out)


def _generate(*args):
    return subprocess.run([sys.executable, "-m", "train.generate", *args], capture_output=True, text=True,
                          cwd=REPO, env=ENV, timeout=300)


def test_greedy_is_deterministic_and_equals_the_reference_loop(trained):
    """Twice: in a fresh process and in this one (another process's state: its random generators drawn from,
    other modules loaded)."""
    ckpt, _ = trained
    runs = [run(str(ckpt), "--prompt", "the owl sat", "--max-new-tokens", "12")
            for run in (_generate, partial(run_module, "train.generate"))]
    assert all(r.returncode == 0 for r in runs), (runs[0].stderr[-2000:], runs[1].stderr[-2000:])
    assert runs[0].stdout == runs[1].stdout == greedy_reference(ckpt, "the owl sat", 12) + "\n"


def test_export_generates_as_the_checkpoint(trained, tmp_path):
    ckpt, _ = trained
    export(str(ckpt), tmp_path, "fp32")
    prompt = prompt_tokens(ByteTokenizer(), "the fox", chat=False, max_tokens=2 ** 31)
    (model, tok), (exported, tok2) = load(str(ckpt), torch.device("cpu")), load(str(tmp_path), torch.device("cpu"))
    assert generate(model, tok, prompt, 10) == generate(exported, tok2, prompt, 10)


def test_sampling_is_seeded_and_a_one_token_nucleus_is_greedy(trained):
    ckpt, _ = trained
    model, tok = load(str(ckpt), torch.device("cpu"))
    prompt = prompt_tokens(tok, "the cat", chat=False, max_tokens=2 ** 31)
    greedy = generate(model, tok, prompt, 10)
    assert generate(model, tok, prompt, 10, temperature=1.0, top_p=1e-9, seed=3) == greedy
    draws = [generate(model, tok, prompt, 10, temperature=1.5, seed=s) for s in (0, 0, 1)]
    assert draws[0] == draws[1] and draws[0] != draws[2]
    assert all(t < tok.vocab_size and t not in (tok.bos_id, tok.pad_id) for d in draws for t in d)


def test_chat_prompt_is_what_training_put_before_a_response():
    """The tokens before the first trained (response) token of an encoded conversation are the prompt that
    ``--chat`` gives the model."""
    tok = ByteTokenizer()
    encoder = ChatEncoder(tok, 2 ** 31)
    trained_tokens = encoder([{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}])
    first_response = int(np.argmax(trained_tokens >= 0))
    assert (~trained_tokens[:first_response]).tolist() == prompt_tokens(tok, "hi there", chat=True,
                                                                        max_tokens=2 ** 31).tolist()


def test_bad_weights_path_is_one_line(tmp_path):
    done = run_module("train.generate", str(tmp_path / "none"), "--prompt", "x")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
