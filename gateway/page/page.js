// The page at /: a file transcribed with its text streamed in (POST /v1/audio/transcriptions
// with stream=true, read as server-sent events), and the microphone transcribed live
// (OpenAI's Realtime transcription session on /v1/realtime, pcm16 at 24 kHz from an AudioWorklet).
"use strict";

const INPUT_RATE = 24000;
const $ = (id) => document.getElementById(id);

function apiKey() {
  return $("api-key").value.trim();
}

function authorization() {
  return apiKey() ? { Authorization: `Bearer ${apiKey()}` } : {};
}

async function modelId() {
  const reply = await fetch("/v1/models", { headers: authorization() });
  if (!reply.ok) throw new Error(await errorMessage(reply));
  return (await reply.json()).data[0].id;
}

async function errorMessage(reply) {
  try {
    return (await reply.json()).error.message;
  } catch {
    return `HTTP ${reply.status}`;
  }
}

function setStatus(element, text, isError = false) {
  element.textContent = text;
  element.classList.toggle("error", isError);
}

// ------------------------------------------------------------------ a file

async function transcribeFile(event) {
  event.preventDefault();
  const status = $("upload-status");
  const output = $("upload-text");
  output.textContent = "";
  setStatus(status, "Transcribing…");
  $("upload-button").disabled = true;
  try {
    const form = new FormData();
    form.append("file", $("file").files[0]);
    form.append("model", await modelId());
    form.append("stream", "true");
    if ($("language").value.trim()) form.append("language", $("language").value.trim());
    const reply = await fetch("/v1/audio/transcriptions", { method: "POST", body: form, headers: authorization() });
    if (!reply.ok) throw new Error(await errorMessage(reply));
    await readEvents(reply, (data) => {
      if (data.type === "transcript.text.delta") output.textContent += data.delta;
      else if (data.type === "transcript.text.done") output.textContent = data.text;
    });
    setStatus(status, "Done.");
  } catch (error) {
    setStatus(status, `Failed: ${error.message}`, true);
  } finally {
    $("upload-button").disabled = false;
  }
}

// Server-sent events: blocks separated by a blank line, each `data: <json>` line an event.
async function readEvents(reply, onEvent) {
  const reader = reply.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = pending.indexOf("\n\n")) >= 0) {
      const block = pending.slice(0, end);
      pending = pending.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) {
          const data = line.slice(5).trim();
          if (data && data !== "[DONE]") onEvent(JSON.parse(data));
        }
      }
    }
  }
}

// ------------------------------------------------------------ the microphone

let live = null; // { socket, stream, context } while the microphone is on (the last two once they are)

function base64(buffer) {
  const bytes = new Uint8Array(buffer);
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

function itemElement(itemId) {
  let element = document.querySelector(`[data-item="${itemId}"]`);
  if (!element) {
    element = document.createElement("p");
    element.dataset.item = itemId;
    element.className = "pending";
    $("live-text").append(element);
  }
  return element;
}

function onServerEvent(message) {
  const event = JSON.parse(message.data);
  switch (event.type) {
    case "conversation.item.input_audio_transcription.delta":
      itemElement(event.item_id).textContent += event.delta;
      break;
    case "conversation.item.input_audio_transcription.completed": {
      const element = itemElement(event.item_id);
      element.textContent = event.transcript;
      element.className = "completed";
      break;
    }
    case "input_audio_buffer.speech_started":
      setStatus($("mic-status"), "Listening: speech…");
      break;
    case "input_audio_buffer.speech_stopped":
      setStatus($("mic-status"), "Listening.");
      break;
    case "error":
      setStatus($("mic-status"), `Error: ${event.error.message}`, true);
      break;
  }
}

async function startMicrophone() {
  const status = $("mic-status");
  setStatus(status, "Connecting…");
  const model = await modelId();
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const protocols = apiKey() ? ["realtime", `openai-insecure-api-key.${apiKey()}`] : [];
  const socket = new WebSocket(`${scheme}//${location.host}/v1/realtime?intent=transcription`, protocols);
  await new Promise((resolve, reject) => {
    socket.onopen = resolve;
    socket.onerror = () => reject(new Error("could not open the live session"));
  });
  live = { socket };
  socket.onmessage = onServerEvent;
  socket.onclose = (event) => {
    if (live && live.socket === socket) stopMicrophone(`Closed: ${event.reason || event.code}`);
  };
  const language = $("language").value.trim() || null;
  socket.send(JSON.stringify({
    type: "session.update",
    session: {
      type: "transcription",
      audio: { input: {
        format: { type: "audio/pcm", rate: INPUT_RATE },
        transcription: { model, language },
        turn_detection: { type: "server_vad", threshold: 0.5, prefix_padding_ms: 300, silence_duration_ms: 500 },
      } },
    },
  }));
  const stream = (live.stream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
  }));
  // The browser resamples the microphone to the context's rate: 24 kHz, as the session takes it.
  const context = (live.context = new AudioContext({ sampleRate: INPUT_RATE }));
  await context.audioWorklet.addModule("/page/pcm-worklet.js");
  const capture = new AudioWorkletNode(context, "pcm16-capture");
  capture.port.onmessage = (message) => {
    if (socket.readyState === WebSocket.OPEN) {
      socket.send(JSON.stringify({ type: "input_audio_buffer.append", audio: base64(message.data) }));
    }
  };
  const silent = context.createGain(); // keeps the graph pulling audio, playing nothing
  silent.gain.value = 0;
  context.createMediaStreamSource(stream).connect(capture).connect(silent).connect(context.destination);
  $("mic-button").textContent = "Stop the microphone";
  setStatus(status, "Listening.");
}

function stopMicrophone(reason = "Stopped.") {
  if (!live) return;
  const { socket, context, stream } = live;
  live = null;
  if (stream) stream.getTracks().forEach((track) => track.stop());
  if (context) context.close();
  if (socket.readyState === WebSocket.OPEN) socket.close();
  $("mic-button").textContent = "Start the microphone";
  setStatus($("mic-status"), reason);
}

async function toggleMicrophone() {
  if (live) {
    stopMicrophone();
    return;
  }
  try {
    await startMicrophone();
  } catch (error) {
    stopMicrophone();
    setStatus($("mic-status"), `Failed: ${error.message}`, true);
  }
}

$("upload").addEventListener("submit", transcribeFile);
$("mic-button").addEventListener("click", toggleMicrophone);
