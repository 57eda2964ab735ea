"""Multi-GPU results of the gather benchmark (``qzero bench gather``), built on the CPU with the
benchmark's own record code (``multi_header``, ``size_entry``) for the tests of what reads them."""

from qzero.app.benchmarks.gather import multi_header, size_entry

ENV = {"device": "test GPU", "sm_count": 1, "torch": "test torch", "triton": "test triton", "cuda": "test cuda",
       "python": "3", "date_utc": "2000-01-01 00:00"}


def gather_result(world: int, sizes: dict, regime: str = "test link", group_size: int = 64) -> dict:
    """``sizes`` maps a flat size (bf16 elements) to ``{arm: [ms of each round]}``."""
    res = multi_header(world, regime, group_size, "bf16", 500_000_000, ENV)
    res["sizes"] = [size_entry(n, 2, times) for n, times in sizes.items()]
    return res
