"""What a training run cost: its measured wall time times the cluster's on-demand hourly price.

Used by "What it cost" in the Dolly notebook, whose original reports "($1.204 * 15 + $2.176) * 2877 / 3600 = $16.17":
15 g4dn.4xlarge and one g4dn.8xlarge (its set-up names an m5.2xlarge head node and 4 g4dn.12xlarge).
Prices change: pass `prices=` with your own (a cloud's price list or your contract) rather than trusting
this table for a budget.
"""

from __future__ import annotations

__all__ = ["INSTANCE_PRICES", "PRICES_AS_OF", "run_cost"]

# AWS EC2 on-demand USD per hour, us-east-1, Linux. The g4dn.4xlarge and g4dn.8xlarge prices are the ones the
# original tutorial used (its run: 2025-09-30; it dates no price); the g4dn and g5 others are from the same
# public price list. The P4 and P5 prices are those after AWS's price cut of up to 45 % for them, effective
# for on-demand use on 2025-06-01 ("Announcing up to 45% price reduction for Amazon EC2 NVIDIA GPU-accelerated
# instances", AWS, 2025-06-05), as SkyPilot's catalog lists them (skypilot-org/skypilot-catalog,
# catalogs/v8/aws/vms.csv at 00148f2a; before the cut, catalogs/v7: p4d 32.7726, p4de 40.96575, p5 98.32).
# Read 2026-11-25.
PRICES_AS_OF = "AWS on demand, us-east-1, 2025-06"
INSTANCE_PRICES = {
    "g4dn.xlarge": 0.526,  # 1 T4
    "g4dn.2xlarge": 0.752,  # 1 T4
    "g4dn.4xlarge": 1.204,  # 1 T4
    "g4dn.8xlarge": 2.176,  # 1 T4
    "g4dn.12xlarge": 3.912,  # 4 T4
    "g5.xlarge": 1.006,  # 1 A10G
    "g5.12xlarge": 5.672,  # 4 A10G
    "p4d.24xlarge": 21.957642,  # 8 A100 40GB
    "p4de.24xlarge": 27.44705,  # 8 A100 80GB: the Llama 2 70B post's nodes (USD 40.97 in its time)
    "p5.48xlarge": 55.04,  # 8 H100 80GB
}


def run_cost(wall_seconds: float, instances: dict[str, int], prices: dict[str, float] | None = None) -> float:
    """US dollars for running `instances` ({instance type: count}) for `wall_seconds`.

    >>> round(run_cost(2877, {"g4dn.4xlarge": 15, "g4dn.8xlarge": 1}), 2)
    16.17
    """
    prices = INSTANCE_PRICES if prices is None else prices
    unknown = sorted(set(instances) - set(prices))
    if unknown:
        raise ValueError(
            f"no price for {', '.join(unknown)}; known: {', '.join(sorted(prices))}. "
            "Pass prices={instance type: USD per hour}."
        )
    if wall_seconds < 0 or any(count < 0 for count in instances.values()):
        raise ValueError("wall_seconds and instance counts must not be negative")
    hourly = sum(prices[name] * count for name, count in instances.items())
    return hourly * wall_seconds / 3600
