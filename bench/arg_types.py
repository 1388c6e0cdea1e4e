"""argparse types shared by the benchmark scripts outside pytest-benchmark."""
import argparse


def int_list(text, at_least=1):
    """``"1,2,4"`` as ints, each at least ``at_least``."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if min(values) < at_least:
        raise argparse.ArgumentTypeError(f"must be at least {at_least}, got {text!r}")
    return values
