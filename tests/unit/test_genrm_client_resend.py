"""GenRMClient against a replica that dies (no Ray Serve: fake responses): every request it held is sent again
at once, not one by one as `collect` reaches it, and each sample is read once."""

from __future__ import annotations

from types import SimpleNamespace

from yatt_ray.reward import client as client_module
from yatt_ray.reward.genrm import JudgeRequest, Verdict


class Response:
    """A request's live attempt: `slow` answers only after that many looks; `dead` raises as Serve does for a
    request its replica held when it died."""

    def __init__(self, key: str, attempt: int, log: list, slow: int = 0, dead: bool = False) -> None:
        self.key, self.attempt, self.log, self.slow, self.dead = key, attempt, log, slow, dead

    def result(self, timeout_s: float):
        if self.dead:
            raise RuntimeError("ActorDiedError: the replica died")
        if self.slow:
            self.slow -= 1
            raise TimeoutError("no verdict yet")
        self.log.append(("read", self.key, self.attempt))
        return Verdict(self.key, 1.0, "Y")

    def cancel(self) -> None:
        pass


def test_the_requests_a_dead_replica_held_are_all_sent_again_while_the_first_still_waits(monkeypatch):
    log: list = []
    sent: dict[str, int] = {}

    def remote(request: JudgeRequest) -> Response:
        n = sent[request.key] = sent.get(request.key, 0) + 1
        log.append(("send", request.key, n))
        if request.key == "k0":  # judged on the live replica, slowly: collect waits on it first
            return Response("k0", n, log, slow=3)
        return Response(request.key, n, log, dead=n == 1)  # held by the replica that died

    monkeypatch.setattr(
        client_module, "_app_handle", lambda timeout_s: SimpleNamespace(judge=SimpleNamespace(remote=remote))
    )
    client = client_module.GenRMClient(timeout_s=60, max_retries=2, connect_timeout_s=1)
    client.submit([JudgeRequest(f"k{i}", "1+2=", "3", "3") for i in range(10)])
    verdicts = client.collect()
    assert sorted(verdicts) == [f"k{i}" for i in range(10)] and not client.pending
    assert sent == {"k0": 1, **{f"k{i}": 2 for i in range(1, 10)}} and client.retries == 9
    resent_at = [i for i, e in enumerate(log) if e[0] == "send" and e[2] == 2]
    k0_read = log.index(("read", "k0", 1))
    assert len(resent_at) == 9 and max(resent_at) < k0_read  # all sent again before k0 answered
    assert [e for e in log if e[0] == "read"].count(
        ("read", "k5", 2)
    ) == 1  # each read once, its live attempt
