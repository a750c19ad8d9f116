"""fusedrnn/benchmark/smallcall.py: the per-call loop prints its figures."""
import re

from fusedrnn.benchmark import smallcall


def test_prints_the_median_and_least_microseconds(capsys):
    smallcall.main(["lstm", "8", "train", "--blocks", "2", "--calls", "3"])
    line = capsys.readouterr().out.strip()
    match = re.fullmatch(r"lstm 8 train us/call median ([0-9.]+) min ([0-9.]+)", line)
    assert match and 0 < float(match[2]) <= float(match[1])
