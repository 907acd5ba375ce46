// Captures the microphone as 16-bit PCM in the AudioContext's sample rate (24 kHz, the
// Realtime API's), posting it to the page in chunks of CHUNK_SAMPLES.
const CHUNK_SAMPLES = 2400; // 100 ms at 24 kHz

class Pcm16Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.chunk = new Int16Array(CHUNK_SAMPLES);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) {
      for (let i = 0; i < channel.length; i++) {
        const sample = Math.max(-1, Math.min(1, channel[i]));
        this.chunk[this.filled++] = sample < 0 ? sample * 0x8000 : sample * 0x7fff;
        if (this.filled === CHUNK_SAMPLES) {
          this.port.postMessage(this.chunk.buffer, [this.chunk.buffer]);
          this.chunk = new Int16Array(CHUNK_SAMPLES);
          this.filled = 0;
        }
      }
    }
    return true;
  }
}

registerProcessor("pcm16-capture", Pcm16Capture);
