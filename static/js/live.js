// The live socket client for /ws/jobs/<id>/ and /ws/cluster/ (docs/architecture.md, section 7).
//
// - Every server message carrying a `seq` is acknowledged with {"type": "ack", "seq": n} once the
//   page has handled it: the server keeps ~32 unacknowledged messages in flight and, when a page
//   falls behind, sends one downsampled `window` instead of the backlog.
// - After a close (server restart, network) it reconnects with exponential backoff, 0.5 s doubling
//   to a 10 s cap with +-20 % jitter so a restarted server is not hit by every tab at once; the
//   server answers each new connection with a fresh `snapshot`, which the page merges by key.
// - Close codes 4401 (not logged in) and 4404 (not your job / no such job) are final.

const BACKOFF_START_MS = 500;
const BACKOFF_MAX_MS = 10000;
const PING_EVERY_MS = 25000;

export class LiveSocket {
  constructor(path, { onMessage, onState } = {}) {
    this.path = path;
    this.onMessage = onMessage || (() => {});
    this.onState = onState || (() => {});
    this.ws = null;
    this.failures = 0;
    this.stopped = false;
    this.timer = null;
    this.pingTimer = null;
    this.state = 'connecting';
    // Counters for the page and the browser tests.
    this.stats = { connects: 0, messages: 0, acks: 0, snapshots: 0, lastSeq: 0, byType: {} };
  }

  get url() {
    const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
    return `${scheme}://${location.host}${this.path}`;
  }

  start() {
    this.stopped = false;
    this._connect();
    return this;
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    clearInterval(this.pingTimer);
    if (this.ws) this.ws.close(1000);
  }

  send(obj) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify(obj));
      return true;
    }
    return false;
  }

  _setState(state, detail = '') {
    this.state = state;
    this.onState(state, detail);
  }

  _connect() {
    clearTimeout(this.timer);
    this._setState(this.stats.connects ? 'reconnecting' : 'connecting');
    let ws;
    try {
      ws = new WebSocket(this.url);
    } catch (err) {
      this._scheduleReconnect();
      return;
    }
    this.ws = ws;
    ws.onopen = () => {
      this.stats.connects += 1;
      clearInterval(this.pingTimer);
      this.pingTimer = setInterval(() => this.send({ type: 'ping' }), PING_EVERY_MS);
    };
    ws.onmessage = (ev) => this._handle(ev.data);
    ws.onclose = (ev) => {
      clearInterval(this.pingTimer);
      if (this.ws !== ws) return;
      this.ws = null;
      if (this.stopped) return;
      if (ev.code === 4401) {
        this._setState('closed', 'signed out: log in again');
        return;
      }
      if (ev.code === 4404) {
        this._setState('closed', 'not found or not yours');
        return;
      }
      this._scheduleReconnect();
    };
    ws.onerror = () => { /* onclose follows and schedules the reconnect */ };
  }

  _scheduleReconnect() {
    const base = Math.min(BACKOFF_MAX_MS, BACKOFF_START_MS * 2 ** this.failures);
    const delay = Math.round(base * (0.8 + 0.4 * Math.random()));
    this.failures += 1;
    this._setState('reconnecting', `retry in ${(delay / 1000).toFixed(1)} s`);
    this.timer = setTimeout(() => this._connect(), delay);
  }

  _handle(raw) {
    let msg;
    try {
      msg = JSON.parse(raw);
    } catch (err) {
      console.warn('trainyard: dropping a malformed frame', err);
      return;
    }
    this.stats.messages += 1;
    this.stats.byType[msg.type] = (this.stats.byType[msg.type] || 0) + 1;
    if (msg.type === 'snapshot') {
      this.stats.snapshots += 1;
      this.failures = 0;
      this._setState('live');
    } else if (msg.type === 'error') {
      console.warn('trainyard: server error frame', msg.error);
    }
    try {
      if (msg.type !== 'pong') this.onMessage(msg);
    } catch (err) {
      console.error('trainyard: handler failed for', msg.type, err);
    } finally {
      if (Number.isInteger(msg.seq)) {
        this.stats.lastSeq = msg.seq;
        if (this.send({ type: 'ack', seq: msg.seq })) this.stats.acks += 1;
      }
    }
  }
}

// Binds a LiveSocket's state to a small "live / reconnecting" pill.
export function bindIndicator(node) {
  return (state, detail) => {
    if (!node) return;
    node.dataset.state = state;
    const label = { live: 'live', connecting: 'connecting…', reconnecting: 'reconnecting…', closed: 'offline' }[state]
      || state;
    node.textContent = label;
    node.title = detail || label;
  };
}
