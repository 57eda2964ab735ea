"""benchmarks/scripts/engine_host.py's timed loops run on gloo (the inline schedule) and leave the
weights as the synchronous gather does."""

import torch

from _support import bench_scripts
from _support.distributed import run_distributed


def worker(rank, world):
    eh = bench_scripts.load("engine_host")
    from qzero.wire.engine import CommContext, start_gather
    from qzero.layout import plan_flat_layout

    shapes, hidden = eh.qwen_like_shapes(200_000, layers=3)
    layout = plan_flat_layout(shapes, world, small_param_numel=4 * hidden, allgather_bucket_size=world * 64 * 200,
                              zero_quantized_weights_format="int8", flat_order="interleaved")
    assert 190_000 < layout.numel < 210_000 and layout.gather.exact_ranges and len(layout.gather.chunks) > 3
    flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(rank)).bfloat16()
    want = flat.clone()
    context = CommContext("cpu")
    start_gather(want, layout.gather, None, context).wait()
    pieces = eh.time_pieces(flat.clone(), layout.gather, None, context, world, rank)
    seconds, n = eh.time_whole(flat, layout.gather, None, context)
    return pieces, seconds, n, torch.equal(flat.view(torch.int16), want.view(torch.int16))


def test_engine_host_loops():
    eh = bench_scripts.load("engine_host")
    for pieces, seconds, n, same in run_distributed(worker, 2):
        assert set(pieces) == set(eh.PIECES) and pieces["pack"] > 0 and pieces["unpack"] > 0
        assert seconds > 0 and n > 3 and same
