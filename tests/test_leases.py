"""The worker's lease schedule, driven by a fake clock."""

from pgq.leases import LeaseSchedule


def test_jobs_are_extended_every_half_retry():
    leases = LeaseSchedule()
    leases.add("a", retry=10, now=0.0)
    leases.add("b", retry=4, now=1.0)
    assert leases.next_at() == 3.0
    assert leases.due(2.9) == []
    assert leases.due(3.0) == ["b"]
    assert leases.next_at() == 5.0
    assert sorted(leases.due(5.0)) == ["a", "b"]
    assert leases.next_at() == 7.0  # b again; a at 10


def test_a_late_check_reports_each_job_once():
    leases = LeaseSchedule()
    leases.add("a", retry=2, now=0.0)
    assert leases.due(3.5) == ["a"]  # due at 1, 2, 3: one extension, not three
    assert leases.next_at() == 4.5


def test_discarded_jobs_are_never_due():
    leases = LeaseSchedule()
    leases.add("a", retry=2, now=0.0)
    leases.add("b", retry=2, now=0.0)
    leases.discard("a")
    assert leases.due(100.0) == ["b"] and len(leases) == 1
    leases.discard("b")
    assert leases.next_at() is None and leases.due(1000.0) == [] and len(leases) == 0


def test_short_leases_are_not_extended_in_a_busy_loop():
    leases = LeaseSchedule(min_interval=0.05)
    leases.add("a", retry=0.001, now=0.0)
    assert leases.next_at() == 0.05
