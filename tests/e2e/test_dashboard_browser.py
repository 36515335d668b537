"""The dashboard in headless Chromium against a live 4-rank server (tiny model, --enable-chaos),
asserting what a person sees: a chaos-slowed rank first on the radar, marked in the ranks table
and named in the header; a kill and its recovery in the events; the scale state after a scale.
Chromium is Debian's (scripts/install-netbed-deps.sh); without it this fails in CI."""

from __future__ import annotations

import re
import time

import pytest

from elastic_ep.cli import main
from elastic_ep.harness.browser import dump_dom
from elastic_ep.harness.load import StreamingLoad
from elastic_ep.harness.server_process import ServerProcess

SLOW, KILLED = 2, 1


def section(dom: str, element_id: str, end: str) -> str:
    """The HTML of the element with `element_id`, up to the first `end` tag after it."""
    start = dom.index(f'id="{element_id}"')
    return dom[start : dom.index(end, start)]


def rows(html: str) -> list[str]:
    return [row for row in html.split("</tr>") if "<td>" in row]


def render_until(page: str, chromium: str, shown, timeout_s: float = 60.0) -> str:
    """The page's DOM once `shown(dom)` holds, rendering again while it does not (a loaded
    machine may move the server on between a /cluster read and the page's)."""
    deadline = time.monotonic() + timeout_s
    while True:
        dom = dump_dom(page, chromium)
        if shown(dom) or time.monotonic() > deadline:
            return dom


def first_radar_row(dom: str) -> str:
    return rows(section(dom, "radar", "</tbody>"))[0]


def straggler(cluster: dict, rank_id: int) -> bool:
    return any(r["rank_id"] == rank_id and (r.get("verdict") or {}).get("kind") == "straggler"
               for r in cluster["ranks"])


@pytest.mark.timeout(300)
def test_what_a_person_sees_on_the_dashboard(tmp_path, chromium, capsys):
    # the straggler policy off: the slowed rank stays a member, so the page shows the verdict alone;
    # a 10 s window of at least 5 steps keeps the verdict on a loaded machine, where steps are slow;
    # no readiness gate: the recovery's and the scale's epochs would each run the warm-up forwards first
    server = ServerProcess(["--model", "tiny-deepseek-v3", "--ep-size", "4", "--enable-chaos",
                            "--straggler-policy", "off", "--straggler-window-s", "10", "--straggler-min-steps", "5",
                            "--restart-delay-s", "1", "--no-warmup-gate"], tmp_path / "serve.log")
    try:
        server.wait_full_group(4)
        assert "fault injection is open" in server.log()
        page = f"{server.url}/dashboard"
        with StreamingLoad(server.url, threads=3, max_tokens=48, prompts=["hello world"]):
            assert main(["chaos", server.url, "slow", str(SLOW), "--delay-s", "0.1"]) == 0
            slowed = server.wait_for(lambda c: straggler(c, SLOW), 60, f"a straggler verdict on rank {SLOW}")
            dom = render_until(page, chromium, lambda dom: "<b>straggler</b>" in first_radar_row(dom))
            radar = rows(section(dom, "radar", "</tbody>"))
            assert f"<td>{SLOW}</td>" in radar[0] and 'class="worst"' in radar[0]
            assert sum('class="worst"' in row for row in radar) == 1
            ratio = float(re.search(r'<td class="num">([\d.]+)×</td>', radar[0]).group(1))
            assert ratio >= slowed["straggler_rule"]["ratio"]
            assert re.search(rf'id="slow">rank {SLOW} \([\d.]+×\)<', dom), "the header names the straggler"
            assert 'id="health">degraded<' in dom and f"rank {SLOW} is a straggler" in dom
            slow_row = next(row for row in rows(section(dom, "ranks", "</tbody>")) if f"<td>{SLOW}</td>" in row)
            assert 'class="worst"' in slow_row and ">straggler " in slow_row
            assert re.search(r'id="tokens-per-s">\d+\.\d<', dom), "throughput on the page"

            assert main(["chaos", server.url, "slow", str(SLOW), "--delay-s", "0"]) == 0
            assert main(["chaos", server.url, "kill", str(KILLED)]) == 0
            server.wait_for(lambda c: any(e["kind"] == "recovered" for e in c["events"]), 60, "a recovery")
            events = section(render_until(page, chromium, lambda dom: ">recovered<" in dom), "events", "</section>")
            assert f"rank {KILLED}: process killed by SIGKILL" in events
            assert '<span class="kind">recovered</span>' in events
        server.wait_full_group(4, timeout_s=90)
        capsys.readouterr()
        server.http.post("/scale_elastic_ep", json={"new_ep_size": 3}).raise_for_status()
        server.wait_for(lambda c: not c["scale"]["is_scaling_elastic_ep"] and len(c["members"]) == 3, 120,
                        "the scale to 3 ranks")
        dom = dump_dom(page, chromium)
        scale = section(dom, "scale", "</dl>")
        assert "<dt>last scale</dt><dd>4 → 3 ranks</dd>" in scale and "<dt>ranks serving</dt><dd>3</dd>" in scale
        phase = server.http.get("/is_scaling_elastic_ep").json()["scale_phase"]
        assert f'id="scale-state">{phase}<' in dom
    finally:
        server.stop()
