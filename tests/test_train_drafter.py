"""eagle_export/samples/train_drafter.py and drafter_data.py: the cached target states, the training-time-test
forward, the loss mask and resumable training, on tiny random models."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.data.prompts import ChatTemplate
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.speculation.eager import parallel_drafts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eagle_export" / "samples"))
import drafter_data  # noqa: E402
import train_drafter  # noqa: E402
from drafter_data import Dataset, answer_mask, greedy_batch, prefill  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A chat template with roles: "w1 w10 <user text> w2" / "w1 w11 <assistant text> w2"; w2 is the EOS.
ROLE_TEMPLATE = ("{% for m in messages %}w1 {{ 'w10' if m['role'] == 'user' else 'w11' }} {{ m['content'] }} w2 "
                 "{% endfor %}{% if add_generation_prompt %}w1 w11{% endif %}")


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp("t") / "t", "llama")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": ROLE_TEMPLATE}))
    return path


@torch.no_grad()
def test_greedy_batch_equals_batch_one_greedy_and_a_full_forward(tiny_target_dir):
    target = load_target(tiny_target_dir, aux_layer_ids=(0, 1)).eval()
    prompts = [[5, 9, 13], [7, 3, 22, 41, 8, 19, 30], [11, 2]]  # ragged on purpose
    # An EOS the tiny model emits early for some prompt, so finished sequences ride along.
    eos = target.generate_greedy(prompts[0], 3)[2]
    for prompt, (tokens, aux, greedy, top_ids, top_logp) in zip(prompts, greedy_batch(target, prompts, 10, eos, 4)):
        expected = target.generate_greedy(prompt, 10, eos_ids=(eos,))
        assert tokens[:len(prompt)] == prompt
        assert tokens[len(prompt):] + [int(greedy[-1])] == expected  # the last token is never fed
        k, v = target.empty_cache(1, 0)
        logits, full_aux, _, _ = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], k, v,
                                        torch.tensor([0]))
        assert torch.allclose(torch.from_numpy(aux), full_aux[0], atol=1e-5)
        assert logits[0].argmax(-1).tolist() == greedy.tolist()
        expected_logp, expected_ids = torch.log_softmax(logits[0], -1).topk(4)
        assert (top_ids == expected_ids.numpy()).all()
        assert np.allclose(top_logp, expected_logp.numpy(), atol=1e-5)


@torch.no_grad()
def test_prefill_equals_the_target_forward_on_padded_batches(tiny_target_dir):
    target = load_target(tiny_target_dir, aux_layer_ids=(0, 2, 6)).eval()
    lengths = [9, 14, 5]
    ids = torch.full((3, 14), 2)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, 320, (n,))
    hidden, aux = prefill(target, ids)
    for b, n in enumerate(lengths):
        k, v = target.empty_cache(1, 0)
        logits, expected_aux, _, _ = target(ids[b:b + 1, :n], torch.arange(n)[None], k, v, torch.tensor([0]))
        assert torch.allclose(aux[b, :n], expected_aux[0], atol=1e-5)
        assert torch.allclose(target.lm_head(hidden[b, :n]), logits[0], atol=1e-5)


def test_answer_mask_marks_assistant_text_and_its_eos(tiny_target_dir):
    template = ChatTemplate(tiny_target_dir)
    messages = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8 w9"},
                {"role": "user", "content": "w12"}, {"role": "assistant", "content": "w13"}]
    ids = template.encode_chat(messages, add_generation_prompt=False)
    answer = answer_mask(template, messages, ids, eos_id=2)
    predicted = [ids[p + 1] for p in range(len(ids) - 1) if answer[p]]
    assert predicted == [7, 8, 9, 2, 13, 2]
    cut = answer_mask(template, messages, ids[:9], eos_id=2)  # cut inside the first answer
    assert [ids[p + 1] for p in range(8) if cut[p]] == [7, 8]


@pytest.mark.parametrize("version", ["3", "3.1"])
def test_training_forward_equals_parallel_drafts(tmp_path, tiny_target_dir, version):
    target = load_target(tiny_target_dir, aux_layer_ids=(1, 3, 4))
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", version), target=target, dtype=torch.float32)
    aux, next_ids = torch.randn(2, 20, 3 * 64) * 3, torch.randint(0, 320, (2, 23))
    for expected, got in zip(parallel_drafts(drafter, next_ids, aux, 4), train_drafter.ttt_logits(drafter, next_ids,
                                                                                                  aux, 4)):
        assert torch.allclose(expected, got, atol=1e-5)


CONVERSATIONS = [[{"role": "user", "content": " ".join(f"w{5 + (i * 7 + j) % 300}" for j in range(4 + i % 5))},
                  {"role": "assistant", "content": " ".join(f"w{5 + (i * 3 + j * 11) % 300}" for j in range(6 + i % 9))}]
                 for i in range(40)]


SELF_DISTILL = ["--self-distill", "--conversations", "0:40", "--max-new-tokens", "6", "--batch", "8"]


def prepare_tiny(monkeypatch, tiny_target_dir, out: Path, tokens: int, *extra):
    monkeypatch.setattr(drafter_data, "sharegpt_conversations", lambda: iter(CONVERSATIONS))
    monkeypatch.setattr(drafter_data, "HELD_OUT", range(0))
    monkeypatch.setattr(sys, "argv", ["train_drafter.py", "prepare", "--out", str(out), "--target", str(tiny_target_dir),
                                      "--aux-layer-ids", "1", "3", "4", "--min-answer", "4", "--chunk", "8",
                                      "--shard-tokens", "100", "--tokens", str(tokens), "--topk", "8", *extra])
    train_drafter.main()


@pytest.mark.parametrize("extra", [[], SELF_DISTILL], ids=["teacher-forced", "self-distilled"])
def test_prepare_continues_where_it_stopped(monkeypatch, tmp_path, tiny_target_dir, extra):
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "whole", 400, *extra)
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "parts", 150, *extra)
    stopped = len(Dataset([tmp_path / "parts"]))
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "parts", 400, *extra)
    whole, parts = Dataset([tmp_path / "whole"]), Dataset([tmp_path / "parts"])
    assert len(whole) == len(parts) > max(16, stopped)
    for i in range(len(whole)):
        a, b = whole.sequence(i), parts.sequence(i)
        assert all((a[f] == b[f]).all() for f in drafter_data.FIELDS)
    seq = whole.sequence(0)
    assert seq["answer"].sum() > 0 and not seq["answer"][:3].any()  # the prompt is never scored


def test_training_resumes_to_the_same_drafter(monkeypatch, tmp_path, tiny_target_dir):
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "data", 600)

    def train(ckpt, tokens, *extra):
        monkeypatch.setattr(sys, "argv", ["train_drafter.py", "train", "--data", str(tmp_path / "data"), "--version",
                                          "3.1", "--ckpt", str(tmp_path / ckpt), "--tokens", str(tokens),
                                          "--batch-tokens", "64", "--draft-vocab", "64", "--topk", "8",
                                          "--eval-every", "1000", "--out", str(tmp_path / ckpt / "drafter"), *extra])
        train_drafter.main()
        return torch.load(tmp_path / ckpt / "state.pt", weights_only=False)

    straight = train("straight", 900)
    train("resumed", 400)
    resumed = train("resumed", 900, "--resume")
    assert straight["step"] == resumed["step"] > 10
    for name, value in straight["drafter"].items():
        assert torch.equal(value, resumed["drafter"][name]), name
    assert load_drafter(tmp_path / "resumed" / "drafter", target=load_target(tiny_target_dir)).config.fc_norm



def test_held_out_metric_scores_answer_positions_only(monkeypatch, tmp_path, tiny_target_dir):
    """evaluate() against a planted drafter: right on every scored step except planted misses, and
    (by construction of the labels) never right on a prompt position. acc@1, the chain estimate and
    the replayed loop must follow from the answer positions alone."""
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "data", 400)
    data, depth, vocab = Dataset([tmp_path / "data"]), 3, 320

    def miss(p, k):
        return (p * 7 + k * 3) % 5 == 0

    real_make_batch, labels_of_batch = train_drafter.make_batch, []

    def make_batch(*args):
        batch = real_make_batch(*args)
        labels_of_batch[:] = [batch[3]]
        return batch

    def planted_logits(drafter, next_ids, aux, k_steps, scored=None):
        out = []
        for k in range(k_steps):
            labels = labels_of_batch[0][k][0]
            predicted = torch.where(labels >= 0, labels, 0)
            predicted = torch.where(torch.tensor([miss(p, k) for p in range(len(labels))]), (predicted + 1) % vocab,
                                    predicted)
            out.append(torch.nn.functional.one_hot(predicted, vocab).float()[None])
        return out

    monkeypatch.setattr(train_drafter, "make_batch", make_batch)
    monkeypatch.setattr(train_drafter, "ttt_logits", planted_logits)
    got = train_drafter.evaluate(torch.nn.Module(), data, torch.arange(vocab), depth, 8)

    hits, leading_all, accepted = np.zeros(depth), [], []
    for i in range(len(data)):
        answer = data.sequence(i)["answer"]
        n = len(answer)

        def scored(p, k):
            return p + k + 1 < n and bool(answer[p + k + 1])

        full = [p for p in range(n) if all(scored(p, k) for k in range(depth))]
        for p in full:
            ok = [not miss(p, k) for k in range(depth)]
            hits += ok
            leading_all.append(next((k for k in range(depth) if not ok[k]), depth))
        step0 = [p for p in range(n) if scored(p, 0)]
        p = step0[0] + 1
        while p <= step0[-1] and p in full:
            accepted.append(next((k for k in range(depth) if miss(p, k)), depth))
            p += accepted[-1] + 1
    assert not data.sequence(0)["answer"][:3].any()  # there are prompt positions to leave out
    assert got["positions"] == len(leading_all) > 50
    assert got["acc"] == (hits / len(leading_all)).round(4).tolist()
    assert 0.5 < got["acc"][0] < 1  # the planted misses show
    assert got["chain_tau"] == round(1 + float(np.mean(leading_all)), 4)
    assert got["rounds"] == len(accepted) and got["replay_tau"] == round(1 + float(np.mean(accepted)), 4)


def test_the_loss_ignores_prompt_positions(monkeypatch, tmp_path, tiny_target_dir):
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "data", 300)
    data = Dataset([tmp_path / "data"])
    target = load_target(tiny_target_dir, aux_layer_ids=(1, 3, 4))
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", "3.1", draft_vocab_size=320), target=target,
                           dtype=torch.float32)
    identity = torch.arange(320)  # the draft vocabulary is the target's
    original = data.sequence

    def loss_with(change):
        def sequence(i):
            s = {f: v.copy() for f, v in original(i).items()}
            change(s)
            return s

        monkeypatch.setattr(data, "sequence", sequence)
        batch = train_drafter.make_batch(data, [0, 1], 3, identity, 8)
        next_ids, aux, scored, labels, draft_top, probs = batch
        logits = train_drafter.ttt_logits(drafter, next_ids, aux, 3, scored)
        return [torch.stack(train_drafter.step_losses(logits, scored, labels, draft_top, probs, objective)[0])
                for objective in ("kd", "kd-tv", "hard")]

    def scramble(s, where):
        s["greedy"][where] = (s["greedy"][where] + 1) % 320
        s["topk_ids"][where] = (s["topk_ids"][where] + 1) % 320

    base = loss_with(lambda s: None)
    prompt = loss_with(lambda s: scramble(s, ~s["answer"]))
    answer = loss_with(lambda s: scramble(s, s["answer"]))
    for b, p, a in zip(base, prompt, answer):
        assert torch.equal(b, p)  # labels on prompt and template positions never reach the loss
        assert not torch.allclose(b, a)


def test_training_continues_a_saved_drafter(monkeypatch, tmp_path, tiny_target_dir):
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "data", 300)
    start = write_tiny_drafter(tmp_path / "start", "3")

    def train(version, out):
        monkeypatch.setattr(sys, "argv", ["train_drafter.py", "train", "--data", str(tmp_path / "data"), "--version",
                                          version, "--ckpt", str(tmp_path / "ckpt"), "--tokens", "0", "--topk", "8",
                                          "--init-from", str(start), "--out", str(out)])
        train_drafter.main()

    train("3", tmp_path / "same")  # no training steps: the saved drafter comes back unchanged
    target = load_target(tiny_target_dir)
    before, after = load_drafter(start, target=target), load_drafter(tmp_path / "same", target=target)
    for name, value in before.state_dict().items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(expected, after.state_dict()[name].to(expected.dtype)), name
    with pytest.raises(SystemExit, match="not an EAGLE-3.1 drafter"):
        train("3.1", tmp_path / "other")


def test_total_variation_equals_the_dense_distance_despite_padding_ids():
    """p known on top-k draft ids, where the ids outside the draft vocabulary arrive as padding (id 0,
    p = 0, repeated): TV must equal 1/2 sum |p - q| over the whole draft vocabulary, padding counted once."""
    torch.manual_seed(0)
    vocab, n = 12, 5
    q = torch.softmax(torch.randn(n, vocab), -1)
    ids = torch.tensor([[3, 7, 0, 0], [0, 5, 9, 0], [11, 2, 0, 0], [4, 0, 0, 0], [1, 6, 8, 10]])
    p = torch.rand(n, 4) * (torch.arange(4) < torch.tensor([2, 3, 2, 1, 4])[:, None])  # zeros: padding
    p[1, 0] = 0.3  # id 0 really in the top-k of row 1, beside padding copies of it
    p = p / p.sum(-1, keepdim=True)
    dense = torch.zeros(n, vocab).scatter_add_(1, ids, p)
    expected = 0.5 * (dense - q).abs().sum(-1)
    assert torch.allclose(train_drafter.total_variation(p, q.gather(1, ids)), expected, atol=1e-6)


def test_layer_init_starts_as_the_targets_last_layer(tiny_target_dir):
    """--init layer: step 0 of the drafter is the target's last layer and head applied to the deepest
    aux state, whatever the token (the token half of q/k/v is zero), for EAGLE-3 (pre-norm residual)."""
    from eagle_export.models.config import DrafterConfig
    from eagle_export.models.drafter import Drafter
    from eagle_export.models.layers import attention_mask, rope_cos_sin

    target = load_target(tiny_target_dir, aux_layer_ids=(1, 3, 4)).eval()
    draft_vocab = torch.tensor([0, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233])
    cfg = train_drafter.drafter_config(target.config, "3", len(draft_vocab), (1, 3, 4))
    drafter = Drafter(DrafterConfig.from_hf(cfg))
    train_drafter.init_from_target(drafter, target, draft_vocab, "layer")
    drafter.share_embeddings(target.embed_tokens)
    t, h = 7, target.config.hidden_size
    aux = torch.randn(1, t, 3 * h)
    with torch.no_grad():
        got = [train_drafter.ttt_logits(drafter, torch.randint(0, 320, (1, t + 1)), aux, 1)[0] for _ in range(2)]
        positions = torch.arange(t)[None]
        cos, sin = rope_cos_sin(positions, target.inv_freq, aux.dtype)
        k, v = target.empty_cache(1, 0)
        mask = attention_mask(positions, torch.tensor([0]), 0)
        out, _, _ = target.layers[-1](aux[..., -h:], cos, sin, k[-1], v[-1], mask)
        expected = target.lm_head(target.norm(out))[..., draft_vocab]
    assert torch.allclose(got[0], expected, atol=1e-4)
    assert torch.allclose(got[1], expected, atol=1e-4)  # other tokens, the same drafts


def test_coverage_counts_held_out_answer_tokens_inside_the_draft_vocabulary(monkeypatch, tmp_path, tiny_target_dir,
                                                                              capsys):
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "data", 300)
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "eval", 200, "--seed", "1")
    data, held_out = Dataset([tmp_path / "data"]), Dataset([tmp_path / "eval"])
    np.save(tmp_path / "data" / "text_counts.npy", np.zeros(320, dtype=np.int64))  # the greedy tokens alone
    monkeypatch.setattr(sys, "argv", ["train_drafter.py", "coverage", "--data", str(tmp_path / "data"), "--eval-data",
                                      str(tmp_path / "eval"), "--sizes", "4", "16", "320"])
    train_drafter.main()
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    greedy = np.concatenate([s["greedy"][s["answer"]] for s in map(held_out.sequence, range(len(held_out)))])
    counts = np.bincount(np.concatenate([data.sequence(i)["greedy"][data.sequence(i)["answer"]]
                                         for i in range(len(data))]), minlength=320)
    for record, size in zip(got, (4, 16, 320)):
        top = np.lexsort((np.arange(320), -counts))[:size]
        assert record["coverage"] == round(float(np.isin(greedy, top).mean()), 4)
        assert record["positions"] == len(greedy)
    assert got[0]["coverage"] < got[1]["coverage"] < got[2]["coverage"] == 1.0


def test_best_out_keeps_the_drafter_of_the_highest_replayed_tau(monkeypatch, tmp_path, tiny_target_dir):
    prepare_tiny(monkeypatch, tiny_target_dir, tmp_path / "data", 400)
    taus, seen = iter([1.10, 1.30, 1.20, 1.25] + [1.05] * 100), []

    def evaluate(drafter, *args):
        seen.append({k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items() if not k.startswith("embed")})
        return {"replay_tau": next(taus)}

    monkeypatch.setattr(train_drafter, "evaluate", evaluate)
    monkeypatch.setattr(sys, "argv", ["train_drafter.py", "train", "--data", str(tmp_path / "data"), "--eval-data",
                                      str(tmp_path / "data"), "--version", "3", "--ckpt", str(tmp_path / "ckpt"),
                                      "--tokens", "500", "--batch-tokens", "64", "--draft-vocab", "64", "--topk", "8",
                                      "--eval-every", "2", "--best-out", str(tmp_path / "best"),
                                      "--log", str(tmp_path / "log.jsonl")])
    train_drafter.main()
    assert len(seen) >= 5  # step 0 and every second step
    best = load_drafter(tmp_path / "best", target=load_target(tiny_target_dir)).state_dict()
    for name, value in seen[1].items():
        assert torch.equal(best[name].to(torch.bfloat16), value), name
    assert not all(torch.equal(seen[1][n], seen[3][n]) for n in seen[1])  # later evaluations saw another drafter
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r.get("best") for r in records] == [1.10, 1.30] + [None] * (len(seen) - 2)
