"""The training loop's learning-rate warmup (``TrainSettings.lr_warmup``, ``--lr-warmup``)."""

import pytest

pytest.importorskip("transformers")

import qzero.app.train as train  # noqa: E402
from _support.distributed import run_distributed  # noqa: E402
from qzero.app.train import TrainSettings, lr_at, validate  # noqa: E402
from qzero.app.workload import WorkloadError  # noqa: E402


def settings(**kw):
    base = dict(preset="tiny", world_size=2, device="cpu", seq_len=32, micro_batch=2, steps=4, warmup=0)
    return TrainSettings(**{**base, **kw})


def test_the_warmup_is_linear_from_lr_over_n_to_lr():
    s = settings(lr=1e-3, lr_warmup=4, steps=6)
    assert [lr_at(s, k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rel=1e-15)
    assert [lr_at(settings(lr=1e-3), k) for k in range(4)] == [1e-3] * 4  # 0: constant


@pytest.mark.parametrize("warm", [-1, 5, 1.5, True, "2"])
def test_a_warmup_that_is_not_a_step_count_within_the_run_is_refused(warm):
    with pytest.raises(WorkloadError, match=rf"lr_warmup must be a whole number of steps from 0 to steps \(4\), "
                                            rf"got {warm!r}"):
        validate(settings(lr_warmup=warm))


def losses_and_lrs(rank, world, runs):
    """Each TrainSettings of ``runs`` trained in turn: rank 0's losses and, per step, the lr of
    every optimizer parameter group as the backend's step began."""
    import os

    os.environ["LOCAL_RANK"] = str(rank)  # deepspeed asks for it
    real = train.build_backend
    out = []
    for s in runs:
        seen = []

        def build(s, device):
            backend, corpus = real(s, device)
            step = backend.step

            def recording():
                seen.append([g["lr"] for g in backend.param_groups()])
                return step()
            backend.step = recording
            return backend, corpus

        train.build_backend = build
        try:
            result = train.train_worker(s, None, show_progress=False)
        finally:
            train.build_backend = real
        out.append((result["losses"] if rank == 0 else None, seen))
    return out


@pytest.mark.parametrize("backend", ["qzero", "fsdp2", "deepspeed"])
def test_every_backend_trains_at_the_warmup_lr(backend):
    """A warmup of 4 steps at lr 1e-3 trains its first step at 2.5e-4, the second at 5e-4: it
    matches a constant 2.5e-4 run to every digit up to the loss the first update sets (step 2's)
    and leaves it at step 3, where its second update lands. The CPU runs are deterministic, so
    anything but an applied schedule would show."""
    runs = [settings(backend=backend, steps=3, lr=1e-3, lr_warmup=4), settings(backend=backend, steps=3, lr=2.5e-4)]
    (warm, warm_lrs), (flat, flat_lrs) = run_distributed(losses_and_lrs, 2, runs, timeout=300)[0]
    assert all(set(g) == {want} for g, want in zip(warm_lrs, [2.5e-4, 5e-4, 7.5e-4])), warm_lrs
    assert all(set(g) == {2.5e-4} for g in flat_lrs)
    assert warm[:2] == flat[:2] and warm[2] != flat[2], (warm, flat)


def test_the_cli_takes_lr_warmup_and_refuses_a_bad_one_in_one_line(capsys):
    from qzero.app import cli

    args = cli.build_parser().parse_args(["train", "--steps", "10", "--lr-warmup", "4"])
    assert cli._train_settings(args).lr_warmup == 4
    assert cli._train_settings(cli.build_parser().parse_args(["train"])).lr_warmup == 0
    assert cli.main(["train", "--device", "cpu", "--steps", "4", "--lr-warmup", "5"]) == cli.EXIT_BAD_ARGS
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == ("qzero: error: lr_warmup must be a whole number of steps from 0 to steps (4), "
                                        "got 5")
