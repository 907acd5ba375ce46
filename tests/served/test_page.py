"""The page at / on the gateway, in headless Chromium driven over the DevTools protocol:
a fake microphone plays a real recording and the page's live text must say what it says."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile
from conftest import AUDIO_DIR
from reference import clips, normalize

websockets = pytest.importorskip("websockets")
from websockets.asyncio.client import connect  # noqa: E402

pytestmark = [pytest.mark.server]

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
KNOWN = {clip.file: clip.transcript for clip in clips()}
PAGE_TIMEOUT_S = 180  # for the text to appear, on a busy 2-core CPU
STARTUP_TIMEOUT_S = 60
LOADED = "document.readyState === 'complete' && document.getElementById('mic-button') !== null"


def page_url(gateway: str) -> str:
    return gateway.removesuffix("/v1") + "/"


def test_the_page_and_its_assets_are_served_from_the_gateway(gateway):
    with urllib.request.urlopen(page_url(gateway)) as reply:
        html = reply.read().decode()
    assert reply.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert "/page/page.js" in assets and "/page/page.css" in assets
    for asset in assets:
        assert asset.startswith("/"), f"{asset}: not served by the gateway"
        with urllib.request.urlopen(page_url(gateway) + asset.lstrip("/")) as reply:
            assert reply.status == 200
    with urllib.request.urlopen(page_url(gateway) + "page/pcm-worklet.js") as reply:
        assert "registerProcessor" in reply.read().decode()


class Browser:
    """One Chromium page, driven through the DevTools protocol."""

    def __init__(self, socket) -> None:
        self.socket, self.ids = socket, itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        await self.socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.socket.recv())
            if message.get("id") == call_id:
                assert "error" not in message, message
                return message["result"]

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True,
                                 userGesture=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = PAGE_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while not (value := await self.evaluate(expression)):
            assert time.monotonic() < deadline, f"never true: {expression}"
            await asyncio.sleep(0.25)
        return value


@contextlib.contextmanager
def chromium(url: str, folder: Path, microphone: Path):
    """Headless Chromium showing `url`, its microphone playing `microphone` (looped); yields
    the DevTools WebSocket URL of the page."""
    profile = folder / "profile"
    command = [
        CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--remote-debugging-port=0", f"--user-data-dir={profile}",
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone}", "--autoplay-policy=no-user-gesture-required", url,
    ]
    log = folder / "chromium.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().strip()):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as reply:
                pages = [t for t in json.load(reply) if t["type"] == "page" and t["url"].startswith(url)]
            if pages:
                break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield pages[0]["webSocketDebuggerUrl"]
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def speech_then_silence(folder: Path, clip: str, silence_s: float) -> Path:
    audio, rate = soundfile.read(AUDIO_DIR / clip, dtype="float32")
    path = folder / "microphone.wav"
    soundfile.write(path, np.concatenate([audio, np.zeros(int(silence_s * rate), np.float32)]), rate,
                    subtype="PCM_16")
    return path


@needs_chromium
def test_the_microphone_button_shows_live_text_of_what_is_said(gateway, tmp_path):
    clip = "sense_and_sensibility_01_austen_64kb-0870.wav"  # seven seconds without a pause: one turn
    url = page_url(gateway)

    async def drive() -> list[str]:
        with chromium(url, tmp_path, speech_then_silence(tmp_path, clip, 3.0)) as devtools:
            async with connect(devtools, max_size=None) as socket:
                browser = Browser(socket)
                await browser.call("Runtime.enable")
                await browser.wait_for(LOADED, STARTUP_TIMEOUT_S)
                await browser.evaluate("document.getElementById('mic-button').click()")
                await browser.wait_for("document.getElementById('mic-button').textContent.startsWith('Stop')",
                                       STARTUP_TIMEOUT_S)
                # Each turn's transcript, once a silence ends it. The fake microphone plays the
                # recording again and again, from before the page listens: the first turn may
                # lack its start, the next ones are whole.
                deadline = time.monotonic() + PAGE_TIMEOUT_S
                while True:
                    completed = await browser.evaluate(
                        "Array.from(document.querySelectorAll('#live-text p.completed')).map(p => p.textContent)")
                    if any(normalize(text) == normalize(KNOWN[clip]) for text in completed):
                        break
                    assert time.monotonic() < deadline, f"no turn says {KNOWN[clip]!r}: {completed}"
                    await asyncio.sleep(0.25)
                status = await browser.evaluate("document.getElementById('mic-status').textContent")
                assert "Error" not in status and "Failed" not in status, status
                await browser.evaluate("document.getElementById('mic-button').click()")
                return completed

    completed = asyncio.run(drive())
    # Every turn after the first (which may have begun mid-word) is a whole pass of the recording.
    assert all(normalize(text) == normalize(KNOWN[clip]) for text in completed[1:]), completed


@needs_chromium
def test_an_uploaded_file_streams_its_text_into_the_page(gateway, tmp_path):
    clip = "jfk.wav"
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0) as client, open(AUDIO_DIR / clip, "rb") as audio:
        try:
            list(client.audio.transcriptions.create(model="whisper-1", file=audio, stream=True))
        except openai.BadRequestError as error:
            if "stream=true is not supported" in str(error):
                pytest.skip("this gateway does not stream transcripts yet (stream=true)")
            raise
    url = page_url(gateway)

    async def drive() -> str:
        with chromium(url, tmp_path, speech_then_silence(tmp_path, clip, 1.0)) as devtools:
            async with connect(devtools, max_size=None) as socket:
                browser = Browser(socket)
                await browser.call("Runtime.enable")
                await browser.call("DOM.enable")
                await browser.wait_for(LOADED, STARTUP_TIMEOUT_S)
                document = await browser.call("DOM.getDocument")
                node = await browser.call("DOM.querySelector", nodeId=document["root"]["nodeId"], selector="#file")
                await browser.call("DOM.setFileInputFiles", nodeId=node["nodeId"], files=[str(AUDIO_DIR / clip)])
                await browser.evaluate("document.getElementById('upload-button').click()")
                await browser.wait_for("document.getElementById('upload-status').textContent !== 'Transcribing…'")
                status = await browser.evaluate("document.getElementById('upload-status').textContent")
                assert status == "Done.", status
                return await browser.evaluate("document.getElementById('upload-text').textContent")

    assert normalize(asyncio.run(drive())) == normalize(KNOWN[clip])
