"""``commpress cluster status`` explains a link it cannot emulate (issue 14).

The explanations are a pure function of a :class:`LinkReport`, so they are checked on reports
built here; tests/test_cluster.py measures real links in network namespaces.
"""

from __future__ import annotations

from commpress.cluster.linkcheck import LinkReport, LinkResult, explain_links
from commpress.cluster.shaping import MAX_EMULATED_BPS


def _inter(requested: float | None, wire: float, *, rtt: float | None = None,
           rtt_min: float = 60e-6, bw_ok: bool | None = None,
           rtt_ok: bool | None = None) -> LinkResult:
    return LinkResult(kind="inter", src=0, dst=1, requested_bps=requested, goodput_bps=wire / 1.05,
                      wire_bps=wire, requested_rtt_s=rtt, rtt_s=rtt_min * 1.5, rtt_min_s=rtt_min,
                      bandwidth_ok=bw_ok, rtt_ok=rtt_ok)


def _intra(goodput: float) -> LinkResult:
    return LinkResult(kind="intra", src=0, dst=0, requested_bps=None, goodput_bps=goodput,
                      wire_bps=goodput, requested_rtt_s=None, rtt_s=30e-6, rtt_min_s=20e-6)


def _report(*links: LinkResult, load: float = 0.1, cpus: int = 2) -> LinkReport:
    return LinkReport(cluster="c", shape_description="x", tolerance=0.1, base_rtt_s=20e-6,
                      links=list(links), load_avg=load, cpus=cpus)


def test_links_within_tolerance_need_no_explanation() -> None:
    report = _report(_inter(1e9, 1.02e9, bw_ok=True), _intra(20e9))
    assert report.ok
    assert report.explanations() == []
    assert "why:" not in report.table()


def test_a_rate_above_the_machines_ceiling_is_explained_with_the_measured_ceiling() -> None:
    report = _report(_inter(20e9, 6e9, bw_ok=False), _intra(8e9))
    (line,) = report.explanations()
    assert "cannot be emulated here" in line and "8 Gbit/s" in line, line
    assert "6 Gbit/s measured" in line, line
    assert "emulate at most 4 Gbit/s" in line, line  # half the measured loopback ceiling
    assert "why: 0 -> 1: 20 Gbit/s cannot be emulated" in report.table()
    assert report.to_dict()["why"] == [line]
    # without a loopback measurement the machine-kind ceiling is used
    (line,) = explain_links(_report(_inter(2 * MAX_EMULATED_BPS, 5e9, bw_ok=False)))
    assert "cannot be emulated here" in line
    assert "emulate at most 7 Gbit/s" in line, line
    # a fast loopback does not raise the advice above what gloo moves
    (line,) = explain_links(_report(_inter(20e9, 16e9, bw_ok=False), _intra(40e9)))
    assert "emulate at most 7 Gbit/s" in line, line


def test_a_slow_link_on_a_busy_machine_blames_the_load() -> None:
    (line,) = explain_links(_report(_inter(1e9, 0.7e9, bw_ok=False), _intra(20e9), load=3.5))
    assert "busy machine" in line and "3.5 on 2 core" in line, line


def test_a_slow_link_on_an_idle_machine_suggests_a_longer_check() -> None:
    (line,) = explain_links(_report(_inter(1e9, 0.7e9, bw_ok=False), _intra(20e9)))
    assert "--seconds 2" in line and "busy" not in line, line


def test_a_rate_above_the_request_is_the_token_buckets_burst() -> None:
    (line,) = explain_links(_report(_inter(1e8, 1.3e8, bw_ok=False), _intra(20e9)))
    assert "burst" in line, line


def test_a_round_trip_below_the_timer_noise_is_explained() -> None:
    (line,) = explain_links(_report(_inter(None, 1e9, rtt=20e-6, rtt_min=200e-6, rtt_ok=False)))
    assert "below what this machine can resolve" in line, line
    (line,) = explain_links(
        _report(_inter(None, 1e9, rtt=2e-3, rtt_min=3e-3, rtt_ok=False), load=4.0)
    )
    assert "instead of 2 ms" in line and "busy machine" in line, line
