"""The control socket's typed replies: built from the wire in one place, refusing what has another shape."""

import pytest

from fusecore.messages import MalformedReply, MountStats, WarmProgress

STATS = {"pid": 7, "cache": {"bytes": 10, "budget": 100, "entries": 1, "hits": 3, "misses": 1, "hit_ratio": 0.75,
                             "staged_bytes": 0},
         "requests": {"get": 5, "list": 1}, "bytes_fetched": 40, "bytes_served": {"cache": 30, "network": 40},
         "inflight": {"requests": 0, "bytes": 0}, "errors": {}}


def test_stats_are_read_from_the_wire_once():
    stats = MountStats.from_wire(STATS)
    assert (stats.pid, stats.cache.bytes, stats.cache.budget, stats.cache.hit_ratio) == (7, 10, 100, 0.75)
    assert (stats.get_requests, stats.bytes_fetched, stats.served_from_cache, stats.served_from_network) == (5, 40, 30, 40)
    assert stats.document is STATS  # the whole reply stays available for display


@pytest.mark.parametrize("broken", [{}, {"pid": 1}, dict(STATS, cache={"bytes": "many", "budget": 1}),
                                    dict(STATS, requests=None)])
def test_a_stats_reply_of_another_shape_is_refused(broken):
    with pytest.raises(MalformedReply):
        MountStats.from_wire(broken)


def test_warm_progress_round_trips_and_ignores_fields_it_does_not_know():
    progress = WarmProgress(files_total=3, bytes_total=30, files_done=1, bytes_done=10)
    assert WarmProgress.from_wire(progress.wire()) == progress
    assert WarmProgress.from_wire(dict(progress.wire(), phase="x", done=True)).done


def test_a_join_request_round_trips_and_refuses_what_a_peer_path_cannot_carry():
    import pytest

    from fusecore.messages import JoinRequest

    request = JoinRequest("ab" * 16, "10.0.0.1:7470", ("10.0.0.1:7470", "10.0.0.2:7470"), 1, b"k" * 32, "/run/x.peer")
    assert JoinRequest.from_wire(request.wire()) == request
    assert "k" * 32 not in repr(request)  # the key is never in a log line made of the request
    for change in ({"name": "AB" * 16}, {"name": "c1"}, {"name": "../../x"}, {"key": "00" * 8}, {"key": "zz"},
                   {"handoff": "relative.peer"}, {"members": "10.0.0.1:7470"}, {"replicas": "x"}):
        with pytest.raises(ValueError):
            JoinRequest.from_wire({**request.wire(), **change})
    with pytest.raises(ValueError):
        JoinRequest.from_wire({k: v for k, v in request.wire().items() if k != "key"})


def test_path_news_round_trips_and_refuses_what_is_not_news():
    from fusecore.messages import PathNews

    news = PathNews("run/step-1/model.pt", "file", "data/run/step-1/model.pt", 12, '"e"', 5.0, True)
    assert PathNews.from_wire(news.to_wire()) == news
    for broken in ({}, {"path": "a", "kind": "link"}, {"path": "/etc/passwd", "kind": "file"},
                   {"path": "a/../b", "kind": "gone"}, {"path": "a//b", "kind": "dir"},
                   {"path": "a", "kind": "file", "size": -1}, {"path": "a", "kind": "file", "size": "big"}, []):
        with pytest.raises(MalformedReply):
            PathNews.from_wire(broken)
