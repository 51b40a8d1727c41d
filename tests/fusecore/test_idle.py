"""The idle-connection pool the store's HTTP clients and the peer client share (fusecore/store/idle.py)."""

from fusecore.store.idle import IdlePool


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_last_given_is_taken_first_and_one_past_the_bound_is_closed():
    closed: list[str] = []
    pool: IdlePool[str, str] = IdlePool(2, closed.append)
    for conn in ("a1", "a2", "a3"):
        pool.give("a", conn)
    pool.give("b", "b1")  # the bound is per place
    assert closed == ["a3"]
    assert [pool.take("a"), pool.take("a"), pool.take("a")] == ["a2", "a1", None]
    assert pool.take("b") == "b1" and pool.take("c") is None


def test_one_idle_too_long_or_no_longer_usable_is_closed_not_taken():
    closed: list[str] = []
    clock = Clock()
    broken = {"dead"}
    pool: IdlePool[str, str] = IdlePool(8, closed.append, usable=lambda c: c not in broken, max_age=5.0, clock=clock)
    pool.give("p", "old")
    clock.now = 3.0
    pool.give("p", "fresh")
    pool.give("p", "dead")
    clock.now = 5.5  # "old" has been idle 5.5 s, "fresh" 2.5 s
    assert pool.take("p") == "fresh" and closed == ["dead"]
    assert pool.take("p") is None and closed == ["dead", "old"]


def test_close_closes_every_idle_connection():
    closed: list[str] = []
    pool: IdlePool[str, str] = IdlePool(4, closed.append)
    pool.give("a", "a1")
    pool.give("b", "b1")
    pool.close()
    assert sorted(closed) == ["a1", "b1"] and pool.take("a") is None
