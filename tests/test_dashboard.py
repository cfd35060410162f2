"""The job dashboard at ``/`` in a real browser: Playwright drives Debian's chromium against a real API
process, a real Celery worker, real Redis and a real S3 server (moto), as a person would use it.

Two API processes share one Redis prefix and so one worker: one in development mode (no key), one in
production mode (API keys). A third, with no worker, holds 10,000 jobs for paging.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_e2e_service import Service, bucket, make_checkpoint, wait_for  # noqa: F401 - bucket is a fixture

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# The README's picture: rewritten only on request, so a test run leaves the checkout as it found it.
README_SCREENSHOT = ROOT / "docs" / "dashboard.png"
UPDATE_SCREENSHOT = os.environ.get("CKPTCONV_UPDATE_SCREENSHOT") == "1"
HOSTILE = '<img src=x onerror="window.__pwned=1">'
HOSTILE_KEY = "<svg onload=window.__pwned=2>missing"
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup-browser.sh (make test does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def service(redis_url: str, bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:  # noqa: F811
    svc = Service(
        redis_url,
        bucket,
        tmp_path_factory.mktemp("dashboard"),
        env={
            "CKPTCONV_ENVIRONMENT": "production",
            "CKPTCONV_WEBHOOK_SECRET": "whsec_ZGFzaGJvYXJkLXRlc3Qtc2VjcmV0",
            # No lost worker here: ordinary beats, so a busy machine does not look like one.
            "CKPTCONV_HEARTBEAT_SECONDS": "5",
            "CKPTCONV_VISIBILITY_TIMEOUT_SECONDS": "60",
        },
    )
    try:
        svc.dev_url = svc.start_api(workers=1, CKPTCONV_ENVIRONMENT="development", CKPTCONV_AUTH_DISABLED="true")
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def page(browser) -> Iterator:
    context = browser.new_context(viewport={"width": 1500, "height": 950})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    # The browser logs every answer >= 400 ("Failed to load resource"); the tests provoke some on purpose.
    page.on(
        "console",
        lambda m: errors.append(m.text) if m.type == "error" and not m.text.startswith("Failed to load") else None,
    )
    try:
        yield page
    finally:
        context.close()
    assert not errors, errors


def submit(url: str, body: dict, key: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(url + "/v1/jobs", json=body, headers=headers, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()


def convert_body(bucket_name: str, source: str, target: str, **labels: str) -> dict:
    return {
        "kind": "convert",
        "source": {"uri": f"s3://{bucket_name}/{source}"},
        "target": {"uri": f"s3://{bucket_name}/{target}", "format": "cs-h5"},
        "labels": labels,
    }


def row(page, job_id: str):
    return page.locator(f'#jobs tr[data-job="{job_id}"]')


def tensors_done(page, job_id: str) -> int:
    text = row(page, job_id).locator(".facts").text_content() or ""
    found = re.search(r"(\d+)/\d+ tensors", text)
    return int(found.group(1)) if found else 0


def test_the_page_ships_with_a_strict_content_security_policy(service: Service) -> None:
    response = httpx.get(service.dev_url + "/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
    scripts = re.findall(r"<script[^>]*>", response.text)
    assert scripts and all('src="/dashboard/' in tag for tag in scripts)  # no inline script
    assert "http://" not in response.text and "https://" not in response.text  # nothing from elsewhere
    module = httpx.get(service.dev_url + "/dashboard/dashboard.js")
    assert module.headers["content-type"].startswith("text/javascript")
    assert "innerHTML" not in module.text and "insertAdjacentHTML" not in module.text
    missing = httpx.get(service.dev_url + "/dashboard/nothing.js")
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"


def test_jobs_appear_move_live_fail_with_their_code_and_cancel(service: Service, page) -> None:
    name = service.bucket
    make_checkpoint(name, "team/dash/long.safetensors", 3000, dim=8)
    failing = submit(service.dev_url, convert_body(name, f"team/dash/{HOSTILE_KEY}.safetensors", "team/dash/none.mdl"))
    long = submit(service.dev_url, convert_body(name, "team/dash/long.safetensors", "team/dash/long.mdl", note=HOSTILE))

    page.goto(service.dev_url + "/")
    page.wait_for_selector(f'#jobs tr[data-job="{long["id"]}"]')
    assert row(page, failing["id"]).count() == 1

    # The failing job shows its code and message (it may fail before or after the page loaded).
    error = row(page, failing["id"]).locator(".error")
    error.wait_for()
    assert error.locator(".error-code").text_content() == "object_not_found"
    assert f"{HOSTILE_KEY}.safetensors" in error.locator(".error-message").text_content()  # the URI, as text
    assert (
        row(page, failing["id"]).locator(".source").text_content() == f"s3://{name}/team/dash/{HOSTILE_KEY}.safetensors"
    )

    # Progress moves without reloading the page: the job's event stream updates the row.
    page.evaluate("window.__samePage = true")
    wait_for(lambda: tensors_done(page, long["id"]) > 0, timeout=60, interval=0.1)
    first = tensors_done(page, long["id"])
    wait_for(lambda: tensors_done(page, long["id"]) > first, timeout=60, interval=0.1)
    assert page.evaluate("window.__samePage") is True
    assert "following" in page.locator("#live").text_content()

    # A hostile label is text, not markup.
    chip = row(page, long["id"]).locator(".label")
    assert chip.text_content() == f"note={HOSTILE}"
    assert page.locator("#jobs img, #jobs svg").count() == 0 and page.evaluate("window.__pwned") is None

    # Cancel from the job's detail.
    row(page, long["id"]).locator("button.link").click()
    page.locator("#detail button.cancel").click()
    page.wait_for_selector(f'#jobs tr[data-job="{long["id"]}"][data-state="cancelled"]')
    assert row(page, long["id"]).locator(".error-code").text_content() == "cancelled"
    assert httpx.get(f"{service.dev_url}/v1/jobs/{long['id']}").json()["state"] == "cancelled"


def test_submit_form_dry_run_and_detail(service: Service, page) -> None:
    name = service.bucket
    make_checkpoint(name, "team/dash/small.safetensors", 6)
    page.goto(service.dev_url + "/")
    page.wait_for_selector("#submit-kind option[value=convert]", state="attached")
    page.select_option("#submit-kind", "convert")
    page.fill("#source-uri", f"s3://{name}/team/dash/small.safetensors")
    page.fill("#target-uri", f"s3://{name}/team/dash/small-out/model.mdl")
    page.select_option("#target-format", "cs-h5")
    page.fill("#labels", "team=nlp, run=7")

    page.click("#dry-run")
    plan = page.locator("#submit-result .plan")
    plan.wait_for()
    assert plan.locator("h3").first.text_content() == "Dry run: ready"
    assert "7" in plan.locator("dl.facts").text_content()  # 6 weights and a bias
    assert not httpx.get(f"{service.dev_url}/v1/jobs", params={"label": "run:7"}).json()["jobs"]  # nothing ran

    page.click("#submit")
    page.wait_for_selector("#submit-result .ok")
    job_id = page.locator("#submit-result .ok").text_content().removeprefix("submitted ")
    page.wait_for_selector(f'#jobs tr[data-job="{job_id}"][data-state="succeeded"]')
    job = httpx.get(f"{service.dev_url}/v1/jobs/{job_id}").json()
    assert job["labels"] == {"team": "nlp", "run": "7"}
    detail = page.locator("#detail")
    detail.locator("code.sha").first.wait_for()
    shown = detail.locator("code.sha").all_text_contents()
    # A file streamed out of order to S3 shows its block digest (its blake3 is null then).
    assert shown == [o["blake3"] or o["blake3_blocks"]["blake3"] for o in job["result"]["outputs"]]
    assert job["result"]["manifest"] in detail.text_content()
    assert "7 tensors" in detail.text_content()  # the plan's totals

    # A refused submission shows the problem's code and message.
    page.fill("#source-uri", "relative/path.safetensors")
    page.click("#submit")
    page.wait_for_selector("#submit-result .error")
    assert page.locator("#submit-result .error-code").text_content() == "invalid_request"


def test_production_mode_asks_for_the_key_and_keeps_it_out_of_urls_and_local_storage(service: Service, page) -> None:
    job = submit(
        service.url,
        convert_body(service.bucket, "team/dash/missing-prod.safetensors", "team/dash/prod.mdl"),
        key=service.key,
    )
    urls: list[str] = []
    authorized: list[str] = []
    page.on("request", lambda r: urls.append(r.url))
    page.on("request", lambda r: authorized.append(r.url) if r.headers.get("authorization") else None)
    page.goto(service.url + "/")
    page.wait_for_selector("#notice:not([hidden])")
    assert "API key" in page.locator("#notice").text_content()
    assert page.locator("#jobs tbody tr").count() == 0

    page.fill("#api-key", service.key)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector(f'#jobs tr[data-job="{job["id"]}"]')
    assert page.locator("#notice").is_hidden()
    assert page.input_value("#api-key") == ""  # not left in the page
    assert page.evaluate("sessionStorage.getItem('ckptconv.apiKey')") == service.key
    assert page.evaluate("localStorage.length") == 0
    assert any("/v1/jobs" in u for u in authorized)
    assert not [u for u in urls if service.key in u]

    page.reload()  # the tab keeps its key
    page.wait_for_selector(f'#jobs tr[data-job="{job["id"]}"]')

    row(page, job["id"]).locator("button.link").click()
    page.locator("#detail .error-code").wait_for()
    page.click("#key-forget")
    page.wait_for_selector("#notice:not([hidden])")
    assert page.evaluate("sessionStorage.getItem('ckptconv.apiKey')") is None
    assert page.locator("#jobs tbody tr").count() == 0 and page.locator("#detail").is_hidden()


# --- 10,000 jobs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crowded(redis_url: str, bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:  # noqa: F811
    """A development-mode API (no worker) whose owner has 10,000 jobs: 1 in 10 a verify, 1 in 7 failed,
    and the newest two verify jobs with their logit comparisons (passed, and failed with a mismatch)."""
    svc = Service(
        redis_url,
        bucket,
        tmp_path_factory.mktemp("crowded"),
        env={"CKPTCONV_ENVIRONMENT": "development", "CKPTCONV_AUTH_DISABLED": "true"},
    )
    try:
        # In a thread of its own: Playwright's sync API keeps an event loop running in this one.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, _seed(redis_url, svc.prefix, bucket, 10_000)).result()
        yield svc
    finally:
        svc.stop()


async def _seed(redis_url: str, prefix: str, bucket_name: str, n: int) -> None:
    import redis
    import redis.asyncio

    from ckptconv.core.auth import DEV_PRINCIPAL
    from ckptconv.core.errors import LogitMismatch
    from ckptconv.core.job_records import new_job_id, new_record
    from ckptconv.core.jobstore import AsyncJobStore, JobStore, RedisKeys

    keys = RedisKeys(prefix)
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    store = AsyncJobStore(client, keys)

    async def create(i: int, kind: str) -> str:
        job_id = new_job_id()
        request = {
            "source": {"uri": f"s3://{bucket_name}/seed/{i}.safetensors"},
            "target": {"uri": f"s3://{bucket_name}/seed/{i}.mdl", "format": "cs-h5"},
            "options": {},
            "labels": {"n": str(i)},
            "webhook": None,
            "max_runtime_seconds": 60,
        }
        rec = new_record(
            job_id,
            owner=DEV_PRINCIPAL.id,
            kind=kind,
            request=request,
            webhook_secret=None,
            created=int(job_id[4:16], 16),
            scopes=None,  # development mode: the owner's key names no prefixes
        )
        # Queued on a queue no worker reads: the records and indexes are what the page reads.
        await store.submit(
            rec,
            labels=request["labels"],
            idem_key=None,
            fingerprint="",
            idem_ttl_seconds=60,
            response_body="",
            queue="seeded",
            message="{}",
        )
        return job_id

    try:
        failed: list[str] = []
        for start in range(0, n - 2, 50):
            batch = range(start, min(n - 2, start + 50))
            ids = await asyncio.gather(*(create(i, "verify" if i % 10 == 0 else "convert") for i in batch))
            failed += [job_id for i, job_id in zip(batch, ids, strict=True) if i % 7 == 0]
        # The newest two, a millisecond apart so that their order is known: verify jobs as a worker
        # records them, one passing and one failing its verdict.
        await asyncio.sleep(0.002)
        passed = await create(n - 2, "verify")
        await asyncio.sleep(0.002)
        mismatched = await create(n - 1, "verify")
    finally:
        await client.aclose()
    with redis.Redis.from_url(redis_url) as r:
        sync = JobStore(r, keys)
        for job_id in failed:
            sync.transition(job_id, ("queued",), "failed", {"error": '{"code":"seeded","detail":"seeded failure"}'})
        sync.transition(passed, ("queued",), "succeeded", {"result": _verdict(True, outputs=[], warnings=[])})
        problem = LogitMismatch("llama: max |diff| 3.000e-02 exceeds tolerance 1e-05", **_verdict(False))
        sync.transition(mismatched, ("queued",), "failed", {"error": problem.to_problem()})


def _verdict(passed: bool, **extra: object) -> dict:
    """The fields a verify job records (ckptconv.jobs.verify)."""
    diff = 1e-7 if passed else 3e-2
    comparison = {"shape": [2, 16, 128], "max_abs_diff": diff, "max_rel_diff": diff / 4, "cosine_similarity": 0.99999}
    return {
        "verdict": "pass" if passed else "fail",
        "passed": passed,
        "max_abs_diff": diff,
        "max_rel_diff": diff / 4,
        "cosine_similarity": 0.99999,
        "tolerance": 1e-5,
        "rtol": 0.0,
        "logits": {"logits": comparison},
        **extra,
    }


def column(page, read: str) -> list[str]:
    # page.wait_for_function would evaluate a string, which the page's CSP forbids (no unsafe-eval).
    return page.locator("#jobs tbody tr").evaluate_all(f"rows => rows.map({read})")


def test_paging_and_filters_over_10000_jobs(crowded: Service, page) -> None:
    page.goto(crowded.url + "/")
    page.wait_for_selector("#jobs tbody tr")
    seen: list[str] = []
    for number in range(1, 4):
        assert page.locator("#page-number").text_content() == f"page {number}"
        ids = column(page, "r => r.dataset.job")
        assert len(ids) == 20 and not set(ids) & set(seen)
        assert ids == sorted(ids, reverse=True) and (not seen or ids[0] < seen[-1])  # newest first, no gap
        seen += ids
        page.click("#page-next")
        page.wait_for_selector(f"#page-number:text('page {number + 1}')")
    page.click("#page-prev")
    page.wait_for_selector("#page-number:text('page 3')")
    assert page.locator("#jobs tbody tr").first.get_attribute("data-job") == seen[40]

    page.select_option("#filter-state", "failed")
    page.wait_for_selector("#page-number:text('page 1')")
    wait_for(lambda: set(column(page, "r => r.dataset.state")) == {"failed"}, timeout=60, interval=0.1)
    assert page.locator("#jobs tbody tr").count() == 20
    assert set(page.locator("#jobs tbody tr .error-code").all_text_contents()) == {"logit_mismatch", "seeded"}

    page.select_option("#filter-state", "")
    page.select_option("#filter-kind", "verify")
    wait_for(lambda: set(column(page, "r => r.cells[1].textContent")) == {"verify"}, timeout=60, interval=0.1)
    assert page.locator("#jobs tbody tr").count() == 20


def test_a_verify_jobs_logit_comparison_in_its_detail(crowded: Service, page) -> None:
    page.goto(crowded.url + "/")
    page.wait_for_selector("#jobs tbody tr")
    mismatched, passed = column(page, "r => r.dataset.job")[:2]
    for job_id, verdict, diff in ((passed, "pass", "1.00000e-7"), (mismatched, "fail", "0.0300000")):
        row(page, job_id).locator("button.link").click()
        page.wait_for_selector(f"#detail h2:text('{job_id}')")
        section = page.locator("#detail .comparison")
        assert section.locator("dd").first.text_content() == verdict
        assert section.locator("tbody td").all_text_contents()[:3] == ["logits", "[2,16,128]", diff]
    assert page.locator("#detail .error-code").text_content() == "logit_mismatch"


def test_screenshot_for_the_readme(service: Service, page, tmp_path: Path) -> None:
    """The picture in README.md: a few finished jobs, one running, one open in the detail panel.

    ``CKPTCONV_UPDATE_SCREENSHOT=1`` writes it to docs/; otherwise it goes to a temporary directory."""
    shot = README_SCREENSHOT if UPDATE_SCREENSHOT else tmp_path / "dashboard.png"
    name = service.bucket
    make_checkpoint(name, "team/demo/llama.safetensors", 24)
    make_checkpoint(name, "team/demo/big.safetensors", 3000, dim=8)
    done = submit(
        service.dev_url, convert_body(name, "team/demo/llama.safetensors", "team/demo/llama.mdl", model="llama")
    )
    wait_for(lambda: httpx.get(f"{service.dev_url}/v1/jobs/{done['id']}").json()["done"], timeout=120)
    running = submit(service.dev_url, convert_body(name, "team/demo/big.safetensors", "team/demo/big.mdl"))
    page.goto(service.dev_url + "/")
    row(page, done["id"]).locator("button.link").click()
    page.locator("#detail code.sha").first.wait_for()
    wait_for(lambda: tensors_done(page, running["id"]) > 100, timeout=60, interval=0.1)
    shot.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    httpx.post(f"{service.dev_url}/v1/jobs/{running['id']}/cancel")
    wait_for(lambda: httpx.get(f"{service.dev_url}/v1/jobs/{running['id']}").json()["done"], timeout=60)
    assert shot.stat().st_size > 10_000
