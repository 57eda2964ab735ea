"""What a CPU verdict's measured bytes would mean on a real cluster: a projection, not a measurement.

[Note: the cluster projection]
On CPU loopback the link costs nothing, so a qualification there measures bytes, not time. This
turns the candidate's measured payload sizes into the traffic each *node* would send per
parameter per step on a cluster of ``nodes`` nodes of ``gpus`` GPUs (``P = nodes x gpus``
ranks), with flat collectives over all ranks:

* the weight all-gather, a ring over all ranks: ``(P - 1) / P x q_w`` bits per parameter per node,
  ``q_w`` the measured weight payload bits per element (16 for a plain bf16 gather);
* the plain gradient reduce-scatter, a ring: ``(P - 1) / P x 16``;
* the quantized gradient all-to-all, each slice straight to its owner: every one of a node's
  ``gpus`` ranks sends the ``(nodes - 1) / nodes`` of its gradient that other nodes own,
  ``gpus x (nodes - 1) / nodes x q_g``;
* FSDP2 with bf16 (a ring all-gather and a ring reduce-scatter): ``2 x (P - 1) / P x 16``,
  31.5 at 8 x 8.

A first-order model (no latency, no overlap, no two-level exchange); :func:`bits_per_param_per_node`
is the one place that computes it, so a fuller cluster cost model can replace it.
"""

from __future__ import annotations

#: The cluster a CPU verdict projects to.
NODES, GPUS_PER_NODE, LINK = 8, 8, "100 GbE"
PLAIN_BITS = 16  # bf16


def bits_per_param_per_node(weight_bits: float, grad_bits: float | None, nodes: int = NODES,
                            gpus: int = GPUS_PER_NODE) -> float:
    """Bits a node sends per parameter per step ([Note: the cluster projection]); ``grad_bits``
    None: the plain gradient reduce-scatter."""
    ranks = nodes * gpus
    ring = (ranks - 1) / ranks
    grads = ring * PLAIN_BITS if grad_bits is None else gpus * (nodes - 1) / nodes * grad_bits
    return ring * weight_bits + grads


def fsdp2_bits_per_param_per_node(nodes: int = NODES, gpus: int = GPUS_PER_NODE) -> float:
    return bits_per_param_per_node(PLAIN_BITS, None, nodes, gpus)


def projection(report: dict) -> str | None:
    """The verdict's projection for the candidate arm, or None where its bytes are not recorded."""
    arm = next((a for a in report.get("arms", []) if a["role"] == "candidate"), None)
    if arm is None or not arm.get("plain_bytes_per_step"):
        return None
    weight_bits = PLAIN_BITS * arm["bytes_sent_per_step"] / arm["plain_bytes_per_step"]
    sent, plain = arm.get("grad_bytes_sent_per_step"), arm.get("grad_plain_bytes_per_step")
    grad_bits = PLAIN_BITS * sent / plain if sent and plain and sent < plain else None
    mine = bits_per_param_per_node(weight_bits, grad_bits)
    return (f"PROJECTION, not measured: on a {LINK} cluster of {NODES} nodes x {GPUS_PER_NODE} GPUs the candidate "
            f"would send {mine:.1f} bits per parameter per node per step against FSDP2's "
            f"{fsdp2_bits_per_param_per_node():.1f} (flat collectives, from the measured payload bytes)")
