"""``mtc_replicator.obs.metrics`` and ``mtc_replicator.csi.call_metrics``: what each call records,
per-job series, ages computed at scrape time, and the no-op default. The HTTP endpoint is tested
with sockets in ``tests/integration/test_metrics.py``."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mtc_replicator.core.contacts import Contacts
from mtc_replicator.core.pacing import DEFAULT_YIELD_TO_SAVES, PaceRules, Traffic
from mtc_replicator.core.timeline import RestorePhase
from mtc_replicator.csi.call_metrics import PrometheusCallMetrics
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.node.options import parse_args as daemon_args
from mtc_replicator.obs.metrics import (
    NO_METRICS,
    ErrorKind,
    Metrics,
    PrometheusMetrics,
    TransferKind,
)

Sample = tuple[str, tuple[tuple[str, str], ...]]


def samples(registry: CollectorRegistry) -> dict[Sample, float]:
    """Every sample of a scrape, keyed by (name, sorted labels), parsed as Prometheus does."""
    text = generate_latest(registry).decode()
    return parse(text)


def parse(text: str) -> dict[Sample, float]:
    out: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return samples(registry).get((name, tuple(sorted(labels.items()))))


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def metrics(clock: Clock) -> PrometheusMetrics:
    return PrometheusMetrics(clock=clock, phases=[p.value for p in RestorePhase])


def test_every_bounded_label_value_is_exported_from_the_start(metrics: PrometheusMetrics) -> None:
    got = samples(metrics.registry)
    for kind in TransferKind:
        assert got[("mtc_transfer_bytes_total", (("kind", kind.value),))] == 0
        assert got[("mtc_transfer_seconds_count", (("kind", kind.value),))] == 0
    for error in ErrorKind:
        assert got[("mtc_errors_total", (("kind", error.value),))] == 0
    for phase in RestorePhase:
        assert got[("mtc_restore_phase_seconds_count", (("phase", phase.value),))] == 0
    # No job yet: no per-job series at all.
    assert not [k for k in got if any(label == "mtc_job" for label, _ in k[1])]


def test_transfers_add_bytes_and_observe_seconds_per_kind(metrics: PrometheusMetrics) -> None:
    metrics.transfer(TransferKind.INGEST, 1000, 0.2)
    metrics.transfer(TransferKind.INGEST, 24, 0.05)
    metrics.transfer(TransferKind.REPLICATE_OUT, 7, 3.0)
    r = metrics.registry
    assert value(r, "mtc_transfer_bytes_total", kind="ingest") == 1024
    assert value(r, "mtc_transfer_seconds_count", kind="ingest") == 2
    assert value(r, "mtc_transfer_seconds_sum", kind="ingest") == pytest.approx(0.25)
    assert value(r, "mtc_transfer_seconds_bucket", kind="ingest", le="0.1") == 1
    assert value(r, "mtc_transfer_bytes_total", kind="replicate_out") == 7
    assert value(r, "mtc_transfer_bytes_total", kind="restore_peer") == 0


def test_errors_count_by_kind(metrics: PrometheusMetrics) -> None:
    metrics.error(ErrorKind.BACKUP)
    metrics.error(ErrorKind.BACKUP)
    metrics.error(ErrorKind.CONFIG)
    r = metrics.registry
    assert value(r, "mtc_errors_total", kind="backup") == 2
    assert value(r, "mtc_errors_total", kind="config") == 1
    assert value(r, "mtc_errors_total", kind="ingest") == 0


def test_identity_refusals_count_by_where(metrics: PrometheusMetrics) -> None:
    r = metrics.registry
    assert value(r, "mtc_identity_refusals_total", where="rank") == 0
    metrics.identity_refused("rpc")
    metrics.identity_refused("rpc")
    assert value(r, "mtc_identity_refusals_total", where="rpc") == 2
    assert value(r, "mtc_identity_refusals_total", where="rank") == 0


def test_restore_rounds_by_outcome_and_their_durations(metrics: PrometheusMetrics) -> None:
    metrics.restore_done("j", 10, 1.5)
    metrics.restore_done("j", None, 0.3)
    metrics.restore_failed("j", 400.0)
    r = metrics.registry
    assert value(r, "mtc_restore_rounds_total", mtc_job="j", outcome="restored") == 1
    assert value(r, "mtc_restore_rounds_total", mtc_job="j", outcome="fresh") == 1
    assert value(r, "mtc_restore_rounds_total", mtc_job="j", outcome="failed") == 1
    assert value(r, "mtc_restore_seconds_sum", outcome="restored") == 1.5
    assert value(r, "mtc_restore_seconds_count", outcome="failed") == 1
    assert value(r, "mtc_restore_seconds_bucket", outcome="failed", le="300.0") == 0


def test_restore_phases_observe_the_seconds_of_each_phase_gone_through(
    metrics: PrometheusMetrics,
) -> None:
    metrics.restore_phases({"join": 0.02, "peer": 0.7})
    metrics.restore_phases({"join": 0.03, "local": 0.0})
    r = metrics.registry
    assert value(r, "mtc_restore_phase_seconds_count", phase="join") == 2
    assert value(r, "mtc_restore_phase_seconds_sum", phase="join") == pytest.approx(0.05)
    assert value(r, "mtc_restore_phase_seconds_bucket", phase="peer", le="0.5") == 0
    assert value(r, "mtc_restore_phase_seconds_bucket", phase="peer", le="1.0") == 1
    assert value(r, "mtc_restore_phase_seconds_count", phase="local") == 1
    assert value(r, "mtc_restore_phase_seconds_count", phase="backup") == 0


def test_newest_steps_and_restorable_ages_per_tier(
    metrics: PrometheusMetrics, clock: Clock
) -> None:
    r = metrics.registry
    metrics.serving("j")
    assert value(r, "mtc_restore_rounds_total", mtc_job="j", outcome="restored") == 0
    metrics.committed("j", 5)
    clock.now += 30
    assert value(r, "mtc_newest_step", mtc_job="j", tier="committed") == 5
    assert value(r, "mtc_newest_restorable_step", mtc_job="j", tier="local") == 5
    assert value(r, "mtc_newest_restorable_age_seconds", mtc_job="j", tier="local") == 30
    # The same step seen again (every rescan) keeps its age; a new one starts at 0.
    metrics.committed("j", 5)
    assert value(r, "mtc_newest_restorable_age_seconds", mtc_job="j", tier="local") == 30
    metrics.committed("j", 6)
    clock.now += 2
    assert value(r, "mtc_newest_restorable_age_seconds", mtc_job="j", tier="local") == 2
    assert value(r, "mtc_newest_restorable_timestamp_seconds", mtc_job="j", tier="local") == (
        clock.now - 2
    )

    metrics.replicated("j", None)  # unknown: nothing
    assert value(r, "mtc_newest_step", mtc_job="j", tier="replicated") is None
    metrics.replicated("j", 6)
    assert value(r, "mtc_newest_step", mtc_job="j", tier="replicated") == 6

    metrics.cluster_restorable("j", 5)
    clock.now += 1
    assert value(r, "mtc_newest_restorable_step", mtc_job="j", tier="cluster") == 5
    assert value(r, "mtc_newest_restorable_age_seconds", mtc_job="j", tier="cluster") == 1

    # A backup's age counts from its COMMIT; an upload not yet committed records nothing,
    # and an older commit (a listing that lags) never moves the gauge back.
    metrics.backed_up("j", 6, None)
    assert value(r, "mtc_newest_step", mtc_job="j", tier="backup") is None
    metrics.backed_up("j", 4, clock.now - 100)
    assert value(r, "mtc_newest_step", mtc_job="j", tier="backup") == 4
    assert value(r, "mtc_newest_restorable_age_seconds", mtc_job="j", tier="backup") == 100
    metrics.backed_up("j", 3, clock.now)
    assert value(r, "mtc_newest_step", mtc_job="j", tier="backup") == 4

    # Nothing complete locally any more: the local series go, the others stay.
    metrics.committed("j", None)
    assert value(r, "mtc_newest_step", mtc_job="j", tier="committed") is None
    assert value(r, "mtc_newest_restorable_step", mtc_job="j", tier="local") is None
    assert value(r, "mtc_newest_step", mtc_job="j", tier="backup") == 4


def test_a_new_job_drops_the_series_of_the_previous_one(metrics: PrometheusMetrics) -> None:
    r = metrics.registry
    metrics.committed("old", 5)
    metrics.backed_up("old", 5, 1.0)
    metrics.restore_done("old", 5, 1.0)
    metrics.off_node_copies("old", 0)
    assert value(r, "mtc_off_node_copies", mtc_job="old") == 0
    metrics.serving("new")
    got = samples(r)
    jobs = {dict(labels).get("mtc_job") for _, labels in got} - {None}
    assert jobs == {"new"}
    assert value(r, "mtc_restore_rounds_total", mtc_job="new", outcome="restored") == 0
    # Counters without a job label keep counting across jobs.
    metrics.transfer(TransferKind.INGEST, 3, 0.1)
    metrics.serving("newer")
    assert value(r, "mtc_transfer_bytes_total", kind="ingest") == 3


def test_jobs_side_by_side_keep_their_series_until_they_end(metrics: PrometheusMetrics) -> None:
    """Job directories (issue 36): every running job's series stay; an ended job's go when
    another starts."""
    running = {"a", "b"}
    metrics.jobs_from(lambda: running)
    for job in ("a", "b"):
        metrics.serving(job)
        metrics.committed(job, 5)
        metrics.off_node_copies(job, 1)
    assert value(metrics.registry, "mtc_off_node_copies", mtc_job="a") == 1
    assert value(metrics.registry, "mtc_off_node_copies", mtc_job="b") == 1
    running.discard("a")  # a ended; c starts in its directory
    running.add("c")
    metrics.serving("c")
    jobs = {dict(labels).get("mtc_job") for _, labels in samples(metrics.registry)} - {None}
    assert jobs == {"b", "c"}


def test_registries_are_independent() -> None:
    a, b = PrometheusMetrics(), PrometheusMetrics()
    a.transfer(TransferKind.SERVE_PULL, 10, 0.1)
    assert value(a.registry, "mtc_transfer_bytes_total", kind="serve_pull") == 10
    assert value(b.registry, "mtc_transfer_bytes_total", kind="serve_pull") == 0


def test_the_default_records_nothing() -> None:
    assert type(NO_METRICS) is Metrics
    NO_METRICS.transfer(TransferKind.INGEST, 1, 1.0)
    NO_METRICS.error(ErrorKind.OTHER)
    NO_METRICS.serving("j")
    NO_METRICS.committed("j", 1)
    NO_METRICS.replicated("j", 1)
    NO_METRICS.cluster_restorable("j", 1)
    NO_METRICS.backed_up("j", 1, 1.0)
    NO_METRICS.restore_done("j", 1, 1.0)
    NO_METRICS.restore_failed("j", 1.0)
    NO_METRICS.restore_phases({"join": 1.0})
    assert vars(NO_METRICS) == {}


def test_csi_calls_count_by_method_and_code() -> None:
    m = PrometheusCallMetrics()
    m.call("NodePublishVolume", "OK", 0.02)
    m.call("NodePublishVolume", "INVALID_ARGUMENT", 0.001)
    m.call("Probe", "OK", 0.0001)
    r = m.registry
    assert value(r, "mtc_csi_calls_total", method="NodePublishVolume", code="OK") == 1
    assert value(r, "mtc_csi_calls_total", method="NodePublishVolume", code="INVALID_ARGUMENT") == 1
    assert value(r, "mtc_csi_call_seconds_count", method="NodePublishVolume") == 2
    assert value(r, "mtc_csi_call_seconds_count", method="Probe") == 1


def test_no_created_series_in_either_exposition(metrics: PrometheusMetrics) -> None:
    metrics.transfer(TransferKind.INGEST, 10, 0.1)
    metrics.committed("j", 3)
    csi = PrometheusCallMetrics()
    csi.call("Probe", "OK", 0.0001)
    for registry in (metrics.registry, csi.registry):
        text = generate_latest(registry).decode()
        assert "_total" in text
        assert "_created" not in text


@pytest.mark.parametrize(
    ("flags", "rule"),
    [
        (("--data-port", "²"), "must be a port"),
        (("--listen", "127.0.0.1:²"), "must be HOST:PORT"),
        (("--metrics", "h:\u0661\u0662"), "must be HOST:PORT"),
    ],
)
def test_non_ascii_digits_in_daemon_flags_are_usage_errors(
    flags: tuple[str, str], rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``"²".isdigit()`` is true and ``int("²")`` fails: our rule in the message, not
    argparse's "invalid value" for a ValueError escaping the check."""
    with pytest.raises(SystemExit) as exited:
        daemon_args(["--checkpoint-dir", "/ckpt", *flags], {})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[0]}: {rule}" in err, err
    assert "invalid _" not in err, err


def test_expand_vars_default_flag_and_environment() -> None:
    base = ["--checkpoint-dir", "/ckpt"]
    assert daemon_args(base, {}).expand_vars == ("NODE_NAME",)
    assert daemon_args(base, {"MTC_EXPAND_VARS": "A, B_2"}).expand_vars == ("A", "B_2")
    assert daemon_args([*base, "--expand-vars", ""], {}).expand_vars == ()
    with pytest.raises(SystemExit) as exited:
        daemon_args([*base, "--expand-vars", "A,$B"], {})
    assert exited.value.code == 2


def test_daemon_metrics_are_off_by_default_and_set_by_flag_or_environment() -> None:
    base = ["--checkpoint-dir", "/ckpt"]
    assert daemon_args(base, {}).metrics is None
    assert daemon_args(base, {"MTC_METRICS": ""}).metrics is None
    assert daemon_args(base, {"MTC_METRICS": "0.0.0.0:9464"}).metrics == "0.0.0.0:9464"
    flagged = daemon_args([*base, "--metrics", "127.0.0.1:0"], {"MTC_METRICS": "h:1"})
    assert flagged.metrics == "127.0.0.1:0"


def test_daemon_refuses_a_bad_metrics_address(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        daemon_args(["--checkpoint-dir", "/ckpt", "--metrics", "9464"], {})
    assert info.value.code == 2
    assert "argument --metrics: must be HOST:PORT, got '9464'" in capsys.readouterr().err


def test_the_pacer_is_read_at_every_scrape(metrics: PrometheusMetrics) -> None:
    pacer = Pacer(PaceRules(rate=1e9))
    metrics.pacing(pacer.counts, 1e9)
    r = metrics.registry
    assert value(r, "mtc_paced_bytes_total", traffic="replication") == 0
    with pacer.transfer(Traffic.REPLICATION) as meter:
        meter.take(3 << 20)
    assert value(r, "mtc_paced_bytes_total", traffic="replication") >= 3 << 20
    assert value(r, "mtc_paced_bytes_total", traffic="restore") == 0
    assert value(r, "mtc_max_transfer_rate_bytes") == 1e9


def test_transfer_rate_flags_and_environment(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--checkpoint-dir", "/ckpt"]
    assert daemon_args(base, {}).max_transfer_rate is None
    assert daemon_args(base, {"MTC_MAX_TRANSFER_RATE": "2Gbit"}).max_transfer_rate == 2.5e8
    flagged = daemon_args([*base, "--max-transfer-rate", "400MiB"], {})
    assert flagged.max_transfer_rate == 400 << 20
    assert daemon_args(base, {}).yield_to_saves_seconds == DEFAULT_YIELD_TO_SAVES
    for bad in (["--max-transfer-rate", "fast"], ["--yield-to-saves-seconds", "60"]):
        with pytest.raises(SystemExit) as exited:
            daemon_args([*base, *bad], {})
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "e.g. 400MiB" in err or "idle" in err, err
        assert "Traceback" not in err


def test_only_the_running_jobs_current_peers_and_fresh_contacts_are_exported(
    metrics: PrometheusMetrics,
) -> None:
    """A peer that moved leaves its old pod IP behind, unreachable: exported, it would fire
    the MtcPeerUnreachable alert for ever."""
    contacts = Contacts(max_age=30.0)
    contacts.unreachable("10.0.0.2:7070", 100.0, "UNAVAILABLE")  # rank 1's old pod
    contacts.unreachable("10.0.0.7:7070", 110.0, "UNAVAILABLE")  # a dead restore source
    contacts.answered("10.0.0.9:7070", 125.0)  # rank 1 now
    contacts.unreachable("10.0.0.3:7070", 125.0, "UNAVAILABLE")  # rank 2, down now
    current = {1: "10.0.0.9:7070", 2: "10.0.0.3:7070"}
    now = [126.0]
    metrics.peer_contacts(lambda: contacts.snapshot(now[0]), current.values)
    got = {k[1]: v for k, v in samples(metrics.registry).items() if k[0] == "mtc_peer_reachable"}
    assert got == {(("peer", "10.0.0.9:7070"),): 1.0, (("peer", "10.0.0.3:7070"),): 0.0}
    current.pop(2)  # the job's next incarnation has one peer
    now[0] = 200.0  # and no contact was refreshed since: stale, whatever the addresses
    current[1] = "10.0.0.2:7070"
    got = {k[1]: v for k, v in samples(metrics.registry).items() if k[0] == "mtc_peer_reachable"}
    assert got == {}


def test_transfers_dropped_under_the_floor_are_counted_by_kind() -> None:
    m = PrometheusMetrics()
    sample = "mtc_transfers_too_slow_total"
    assert m.registry.get_sample_value(sample, {"kind": "replicate_in"}) == 0
    m.transfer_too_slow(TransferKind.REPLICATE_IN)
    m.transfer_too_slow(TransferKind.SERVE_PULL)
    m.transfer_too_slow(TransferKind.SERVE_PULL)
    assert m.registry.get_sample_value(sample, {"kind": "replicate_in"}) == 1
    assert m.registry.get_sample_value(sample, {"kind": "serve_pull"}) == 2
