"""Weight version retention: the newest run.keep_weight_versions, every run.keep_weight_every-th, LATEST and the
versions live workers hold survive a sequence of publishes with garbage collection after each."""

from __future__ import annotations

from buffer import heartbeats, weights

from .buffer_helpers import make_layout, publish_version


def test_keep_last_k_and_every_nth_across_publishes(tmp_path):
    layout = make_layout(tmp_path)
    deleted: list[int] = []
    for v in range(1, 13):
        publish_version(layout, v)
        deleted += weights.garbage_collect(layout, keep=2, in_use=[], every=5)
        # after every publish: the two newest and the multiples of 5 published so far, nothing else
        assert weights.published_versions(layout) == sorted({v - 1, v} - {0} | {m for m in (5, 10) if m <= v})
    assert deleted == [1, 2, 3, 4, 6, 7, 8, 9]
    assert weights.published_versions(layout) == [5, 10, 11, 12]


def test_versions_of_live_workers_survive_retention(tmp_path):
    layout = make_layout(tmp_path)
    heartbeats.worker_status(layout, "w0", slot=0).update(state="running", weights_version=3)
    heartbeats.worker_status(layout, "w1", slot=1).update(state="stopped", weights_version=4)
    for v in range(1, 9):
        publish_version(layout, v)
        weights.garbage_collect(layout, keep=1, in_use=heartbeats.versions_in_use(layout), every=4)
    # 3: a running worker holds it; 4 and 8: milestones; 8: newest; 4 is kept as a milestone, not for the stopped w1
    assert weights.published_versions(layout) == [3, 4, 8]


def test_retained_without_milestones_is_the_newest_k():
    assert weights.retained([1, 2, 3, 4], keep=2) == {3, 4}
    assert weights.retained([2, 4, 6, 9], keep=1, every=3) == {6, 9}
    assert weights.retained([1, 2], keep=5, every=0) == {1, 2}


def test_the_evaluators_best_version_survives_retention(tmp_path):
    """``weights/BEST.json`` (the evaluator's best-scoring version) is kept however many versions follow it, so the
    version a demo names as the one to export can be exported; a damaged record keeps nothing extra."""
    layout = make_layout(tmp_path)
    for v in range(1, 4):
        publish_version(layout, v)
    weights.record_best(layout, 2, 0.9)
    assert weights.best_version(layout) == (2, 0.9)
    for v in range(4, 10):
        publish_version(layout, v)
        weights.garbage_collect(layout, keep=2, in_use=[])
    assert weights.published_versions(layout) == [2, 8, 9]
    layout.best_pointer.write_text("{not json")
    assert weights.best_version(layout) is None
    publish_version(layout, 10)
    weights.garbage_collect(layout, keep=2, in_use=[])
    assert weights.published_versions(layout) == [9, 10]


def test_collection_reads_no_delta_record_of_a_full_version(tmp_path, monkeypatch):
    """A full version has no delta record; asking for it would wait out the retries a missing file gets on a
    network filesystem, for every kept version at every publish (seconds of sleep a publish, once)."""
    layout = make_layout(tmp_path)
    asked: list[str] = []
    real = weights.read_delta_record

    def counting(path):
        asked.append(path.name)
        return real(path)

    monkeypatch.setattr(weights, "read_delta_record", counting)
    for v in range(1, 6):
        publish_version(layout, v)
        weights.garbage_collect(layout, keep=3, in_use=[])
    assert weights.published_versions(layout) == [3, 4, 5]
    assert asked == []
