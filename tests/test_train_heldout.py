"""The held-out loss of ``qzero train`` (settings ``heldout``, ``eval_every``, ``eval_sequences``):
the split of the corpus, the fixed windows, the measurement against a plain module, and that
measuring changes nothing of the training."""

import hashlib
import math

import pytest
import torch

pytest.importorskip("transformers")

import qzero.app.train as train  # noqa: E402
from _support.distributed import run_distributed  # noqa: E402
from qzero.app import cli  # noqa: E402
from qzero.app.heldout import heldout_loss  # noqa: E402
from qzero.app.train import TrainSettings, validate  # noqa: E402
from qzero.app.workload import (WorkloadError, build_model, global_batch, heldout_windows, load_corpus,  # noqa: E402
                                model_config, split_corpus)

#: sha256 of global_batch(arange(100_000), step, 8, 64, seed) for steps 0..2 and seeds 0 and 7,
#: computed with the code before the held-out split existed: heldout 0 must draw exactly these.
FROZEN_DRAW = "eac0efa29bda8971a0f4d4968e5ba8b2180e34e64d168bf5806abceec38077da"


def settings(**kw):
    base = dict(preset="tiny", world_size=2, device="cpu", seq_len=32, micro_batch=2, steps=4, warmup=0)
    return TrainSettings(**{**base, **kw})


@pytest.mark.parametrize("kw,match", [
    (dict(heldout=-0.1), "heldout must be a fraction"),
    (dict(heldout=1.0), "heldout must be a fraction"),
    (dict(heldout=float("nan")), "heldout must be a fraction"),
    (dict(heldout="0.1"), "heldout must be a fraction"),
    (dict(heldout=True), "heldout must be a fraction"),
    (dict(heldout=0.1, eval_every=-1), "eval_every must be an integer >= 0, got -1"),
    (dict(heldout=0.1, eval_every=1.5), "eval_every must be an integer >= 0, got 1.5"),
    (dict(heldout=0.1, eval_sequences=0), "eval_sequences must be an integer >= 1, got 0"),
    (dict(eval_every=2), "eval_every 2 measures the held-out loss, but heldout is 0"),
    (dict(heldout=0.1, eval_every=1), "eval_every 1 .* leaves no step of 4 timed"),
])
def test_bad_heldout_settings_are_refused_naming_the_setting(kw, match):
    with pytest.raises(WorkloadError, match=match):
        validate(settings(**kw))


def test_both_parts_of_the_split_must_hold_a_window(tmp_path):
    data = tmp_path / "text.txt"
    data.write_bytes(bytes(range(256)) + bytes(44))  # 300 tokens
    validate(settings(data=str(data), heldout=0.2))  # 60 held out, 240 to train on: both fit a window of 33
    with pytest.raises(WorkloadError, match=r"heldout 0.05 of the 300-token data holds out 15 tokens, fewer than "
                                            r"one window of seq_len \+ 1 = 33"):
        validate(settings(data=str(data), heldout=0.05))
    with pytest.raises(WorkloadError, match=r"heldout 0.95 of the 300-token data leaves 15 tokens to train on, "
                                            r"fewer than the seq_len \+ 2 = 34"):
        validate(settings(data=str(data), heldout=0.95))


def test_the_cli_refuses_eval_every_without_heldout_in_one_line(capsys):
    assert cli.main(["train", "--device", "cpu", "--steps", "4", "--eval-every", "2"]) == cli.EXIT_BAD_ARGS
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qzero: error: eval_every 2 measures the held-out loss")
    args = cli.build_parser().parse_args(["train", "--heldout", "0.1", "--eval-every", "3", "--eval-sequences", "5"])
    s = cli._train_settings(args)
    assert (s.heldout, s.eval_every, s.eval_sequences) == (0.1, 3, 5)


def test_heldout_0_draws_the_batches_of_before():
    corpus = torch.arange(100_000)
    train_part, held = split_corpus(corpus, 0.0, 64)
    assert train_part.numel() == corpus.numel() and held.numel() == 0
    h = hashlib.sha256()
    for step in range(3):
        for seed in (0, 7):
            h.update(global_batch(train_part, step, 8, 64, seed).numpy().tobytes())
    assert h.hexdigest() == FROZEN_DRAW


@pytest.mark.parametrize("heldout,seq_len", [(0.05, 64), (0.3, 16), (0.5, 100)])
def test_training_windows_never_reach_the_heldout_part(heldout, seq_len):
    corpus = torch.arange(20_000)  # a token is its position
    train_part, held = split_corpus(corpus, heldout, seq_len)
    split = corpus.numel() - int(heldout * corpus.numel())
    assert train_part.numel() == split and held[0] == split and held[-1] == corpus.numel() - 1
    ends = torch.cat([global_batch(train_part, step, 64, seq_len, 3)[:, -1] for step in range(50)])
    assert int(ends.max()) < split  # every window's last token (start + seq_len) before the split
    assert int(ends.max()) > split - 200  # and the draw does reach the end of the training part
    windows = heldout_windows(held, 7, seq_len)
    starts = windows[:, 0].tolist()
    assert windows.shape == (7, seq_len + 1) and torch.equal(windows - windows[:, :1],
                                                             torch.arange(seq_len + 1).expand(7, -1))
    assert starts[0] == split and starts[-1] + seq_len == corpus.numel() - 1  # first token to last window
    gaps = {b - a for a, b in zip(starts, starts[1:])}
    assert max(gaps) - min(gaps) <= 1  # evenly spaced
    assert torch.equal(heldout_windows(held, 7, seq_len), windows)  # no seed, no step: always these


# ---------------------------------------------------------------------- the measurement itself


def measure(rank, world, counts):
    """heldout_loss of one fixed model on every rank (every count of windows), the model's mode and
    the RNG state before and after."""
    torch.manual_seed(1)
    corpus = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(5))
    model = build_model(model_config("tiny"), torch.bfloat16, torch.device("cpu"), seed=0)
    out = []
    for n in counts:
        windows = heldout_windows(corpus[4000:], n, 32)
        model.train(n % 2 == 0)
        before = torch.get_rng_state()
        loss = heldout_loss(model, windows, 2, torch.device("cpu"))
        out.append((loss, model.training == (n % 2 == 0), torch.equal(before, torch.get_rng_state())))
    return out


def reference(model, windows) -> float:
    """The mean next-token cross-entropy of ``windows`` in one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 windows[:, 1:].reshape(-1)).item()


def test_the_heldout_loss_is_the_same_at_every_world_size_and_that_of_a_plain_forward():
    counts = (5, 2, 8)  # 5: uneven shares; 2: at world 3 a rank with no window still runs its forward
    corpus = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(5))
    model = build_model(model_config("tiny"), torch.bfloat16, torch.device("cpu"), seed=0)
    want = [reference(model, heldout_windows(corpus[4000:], n, 32)) for n in counts]
    got = {world: run_distributed(measure, world, counts, timeout=300) for world in (1, 2, 3)}
    for world, ranks in got.items():
        for r in ranks:  # every rank gets the same figure, the model's mode is restored, no RNG drawn
            assert [x[0] for x in r] == [x[0] for x in ranks[0]] and all(x[1] and x[2] for x in r)
        # the windows' losses are the same but summed in other groupings: equal to fp32 summation error
        assert [x[0] for x in ranks[0]] == pytest.approx(want, rel=1e-6, abs=0), world
    assert len(set(want)) == 3  # the counts really are different sets of windows


# ---------------------------------------------------------------------- in the training loop


def capture(rank, world, runs):
    """Each TrainSettings of ``runs`` trained in turn; per run rank 0's record and the weights after
    every held-out measurement (the backend's gather finished first, gathered in full, bf16)."""
    import os

    from qzero.app import workload

    os.environ["LOCAL_RANK"] = str(rank)  # deepspeed asks for it
    real, draw = train.build_backend, workload.global_batch
    out = []
    for s in runs:
        snaps, drawn_from = [], set()

        def build(s, device):
            backend, corpus = real(s, device)
            done = backend.forward_only_done

            def snapshot():
                done()
                backend.finish()
                snaps.append({
                    n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).to(torch.bfloat16, copy=True)
                    for n, p in backend.model.named_parameters()})
            backend.forward_only_done = snapshot
            return backend, corpus

        def batch(corpus, *args):
            drawn_from.add(corpus.numel())
            return draw(corpus, *args)

        train.build_backend, workload.global_batch = build, batch
        try:
            result = train.train_worker(s, None, show_progress=False)
        finally:
            train.build_backend, workload.global_batch = real, draw
        out.append((result, snaps, drawn_from) if rank == 0 else None)
    return out


def heldout_reference(snapshot: dict, s: TrainSettings) -> float:
    """The held-out loss of ``snapshot``'s weights on a plain module, over windows cut here. The
    module is built as the backend builds it: FSDP2's in fp32, computing with bf16 weights (its
    mixed precision) beside fp32 buffers (the rotary frequencies); the others' in bf16."""
    fsdp = s.backend == "fsdp2"
    model = build_model(model_config(s.preset), torch.float32 if fsdp else torch.bfloat16, torch.device("cpu"), seed=99)
    missing, unexpected = model.load_state_dict(snapshot, strict=False)
    assert not missing and not unexpected
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    corpus = load_corpus(s.data)
    split = corpus.numel() - int(s.heldout * corpus.numel())
    room = corpus.numel() - split - (s.seq_len + 1)
    starts = [split + (i * room // (s.eval_sequences - 1) if s.eval_sequences > 1 else 0)
              for i in range(s.eval_sequences)]
    return reference(model, torch.stack([corpus[a : a + s.seq_len + 1] for a in starts]))


QUANTIZED = {"zero_quantized_weights": True}


def test_measuring_changes_no_training_loss_and_reads_the_current_weights_with_gather_ahead():
    """qzero with gather-ahead, measured every 2 steps, against the same run measured only at the end
    and against the run without gather-ahead: the training losses and norms are the same bits (the
    measurement draws nothing, changes no weight, and gather-ahead changes only when the gather runs),
    so are the held-out losses; each equals a plain module's loss with the weights of that step."""
    every2 = settings(heldout=0.1, eval_every=2, eval_sequences=5, zero={**QUANTIZED, "overlap_param_gather": True})
    runs = [every2, settings(heldout=0.1, eval_sequences=5, zero={**QUANTIZED, "overlap_param_gather": True}),
            settings(heldout=0.1, eval_every=2, eval_sequences=5, zero={**QUANTIZED, "overlap_param_gather": False})]
    (ahead, snaps, drawn_from), (last_only, _, _), (plain, _, _) = run_distributed(capture, 2, runs, timeout=600)[0]
    total = load_corpus().numel()
    assert drawn_from == {total - int(0.1 * total)}  # the batches come from the training part only
    assert ahead["losses"] == last_only["losses"] == plain["losses"]
    assert ahead["grad_norms"] == last_only["grad_norms"] == plain["grad_norms"]
    assert [s for s, _ in ahead["heldout_losses"]] == [2, 4] and [s for s, _ in last_only["heldout_losses"]] == [4]
    assert (ahead["heldout_losses"] == plain["heldout_losses"]
            and ahead["heldout_losses"][-1] == last_only["heldout_losses"][-1])
    # steps 0 and 2 are timed (1 is followed by a measurement, 3 is the last)
    assert len(ahead["step_times"]) == 2 and len(last_only["step_times"]) == 3 and ahead["heldout_seconds"] > 0
    refs = [heldout_reference(w, every2) for w in snaps]
    assert [loss for _, loss in ahead["heldout_losses"]] == pytest.approx(refs, rel=1e-6, abs=0)
    assert abs(refs[0] - refs[1]) > 1e-2  # the weights moved: a measurement of stale weights would be told apart


def test_the_peer_backends_measure_their_current_weights():
    """FSDP2 (sharded: every rank's forwards pair up, the weights resharded after) and DeepSpeed: the
    held-out losses are those of a plain module with the weights gathered in full, and the training
    losses those of the run measured at the end only."""
    runs = [settings(backend="fsdp2", heldout=0.1, eval_every=2, eval_sequences=1),  # rank 1: no window, a forward
            settings(backend="fsdp2", heldout=0.1, eval_sequences=1),
            settings(backend="deepspeed", heldout=0.1, eval_every=2, eval_sequences=3)]
    (fsdp, fsdp_snaps, _), (fsdp_last, _, _), (ds, ds_snaps, _) = run_distributed(capture, 2, runs, timeout=300)[0]
    assert fsdp["losses"] == fsdp_last["losses"] and fsdp["heldout_losses"][-1] == fsdp_last["heldout_losses"][-1]
    for result, snaps, s in ((fsdp, fsdp_snaps, runs[0]), (ds, ds_snaps, runs[2])):
        assert [step for step, _ in result["heldout_losses"]] == [2, 4]
        refs = [heldout_reference(w, s) for w in snaps]
        assert [loss for _, loss in result["heldout_losses"]] == pytest.approx(refs, rel=1e-6, abs=0), s.backend
        assert all(math.isfinite(x) for x in result["losses"])
