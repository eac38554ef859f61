// A strict msgpack codec for the session protocol (PROTOCOL.md section 2): maps with string keys,
// no extension types, no duplicate keys, no trailing bytes, bounded nesting and lengths. Encoding
// picks the smallest representation, floats as float64, byte arrays as bin: the same bytes as the
// Python implementation (msgpack.packb(use_bin_type=True)).

export type Value = null | boolean | number | bigint | string | F64 | Uint8Array | Value[] | { [k: string]: Value };

/** A float on the wire (msgpack float64), kept apart from integers so that strict readers can
 * refuse 1.0 where an integer is due, and writers emit a float where Python would. */
export class F64 {
  constructor(public v: number) {}
}

export class FrameError extends Error {
  constructor(message: string) {
    super(message);
  }
}

const MAX_DEPTH = 32;

export function encode(v: Value): Uint8Array {
  const out: number[] = [];
  write(v, out);
  return Uint8Array.from(out);
}

function u(out: number[], n: number, bytes: number): void {
  for (let i = bytes - 1; i >= 0; i--) out.push(Math.floor(n / 2 ** (8 * i)) & 0xff);
}

function write(v: Value, out: number[]): void {
  if (v === null) out.push(0xc0);
  else if (v === true) out.push(0xc3);
  else if (v === false) out.push(0xc2);
  else if (typeof v === "bigint") writeInt(v, out);
  else if (v instanceof F64) {
    out.push(0xcb);
    const b = new DataView(new ArrayBuffer(8));
    b.setFloat64(0, v.v);
    for (let i = 0; i < 8; i++) out.push(b.getUint8(i));
  }
  else if (typeof v === "number") {
    if (Number.isInteger(v) && !Object.is(v, -0)) writeInt(BigInt(v), out);
    else {
      out.push(0xcb);
      const b = new DataView(new ArrayBuffer(8));
      b.setFloat64(0, v);
      for (let i = 0; i < 8; i++) out.push(b.getUint8(i));
    }
  } else if (typeof v === "string") {
    const s = new TextEncoder().encode(v);
    if (s.length < 32) out.push(0xa0 | s.length);
    else if (s.length < 256) out.push(0xd9, s.length);
    else if (s.length < 65536) (out.push(0xda), u(out, s.length, 2));
    else (out.push(0xdb), u(out, s.length, 4));
    for (const x of s) out.push(x);
  } else if (v instanceof Uint8Array) {
    if (v.length < 256) out.push(0xc4, v.length);
    else if (v.length < 65536) (out.push(0xc5), u(out, v.length, 2));
    else (out.push(0xc6), u(out, v.length, 4));
    for (const x of v) out.push(x);
  } else if (Array.isArray(v)) {
    if (v.length < 16) out.push(0x90 | v.length);
    else if (v.length < 65536) (out.push(0xdc), u(out, v.length, 2));
    else (out.push(0xdd), u(out, v.length, 4));
    for (const x of v) write(x, out);
  } else {
    const keys = Object.keys(v);
    if (keys.length < 16) out.push(0x80 | keys.length);
    else (out.push(0xde), u(out, keys.length, 2));
    for (const k of keys) {
      write(k, out);
      write(v[k], out);
    }
  }
}

function writeInt(n: bigint, out: number[]): void {
  if (n >= 0n) {
    if (n < 128n) out.push(Number(n));
    else if (n < 256n) out.push(0xcc, Number(n));
    else if (n < 65536n) (out.push(0xcd), u(out, Number(n), 2));
    else if (n < 2n ** 32n) (out.push(0xce), u(out, Number(n), 4));
    else {
      out.push(0xcf);
      for (let i = 7n; i >= 0n; i--) out.push(Number((n >> (8n * i)) & 0xffn));
    }
  } else {
    if (n >= -32n) out.push(0x100 + Number(n));
    else if (n >= -128n) out.push(0xd0, (0x100 + Number(n)) & 0xff);
    else if (n >= -32768n) (out.push(0xd1), u(out, 0x10000 + Number(n), 2));
    else if (n >= -(2n ** 31n)) (out.push(0xd2), u(out, 2 ** 32 + Number(n), 4));
    else {
      const m = 2n ** 64n + n;
      out.push(0xd3);
      for (let i = 7n; i >= 0n; i--) out.push(Number((m >> (8n * i)) & 0xffn));
    }
  }
}

/** Decode one frame: exactly one value, which must be a map. */
export function decode(buf: Uint8Array, maxLen = 1 << 20): { [k: string]: Value } {
  const r = new ByteReader(buf, maxLen);
  const v = r.value(0);
  if (r.pos !== buf.length) throw new FrameError(`${buf.length - r.pos} bytes after the message`);
  if (v === null || typeof v !== "object" || Array.isArray(v) || v instanceof Uint8Array || v instanceof F64) {
    throw new FrameError("a frame must be a msgpack map");
  }
  return v;
}

class ByteReader {
  pos = 0;
  private view: DataView;
  constructor(
    private buf: Uint8Array,
    private maxLen: number,
  ) {
    this.view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  }
  private need(n: number): void {
    if (n > this.maxLen || this.pos + n > this.buf.length) throw new FrameError("a length runs past the frame");
  }
  private u8(): number {
    this.need(1);
    return this.buf[this.pos++];
  }
  private uint(bytes: number): number {
    this.need(bytes);
    let n = 0;
    for (let i = 0; i < bytes; i++) n = n * 256 + this.buf[this.pos++];
    return n;
  }
  private bytes(n: number): Uint8Array {
    this.need(n);
    const b = this.buf.slice(this.pos, this.pos + n);
    this.pos += n;
    return b;
  }
  private str(n: number): string {
    return new TextDecoder("utf-8", { fatal: true }).decode(this.bytes(n));
  }
  value(depth: number): Value {
    if (depth > MAX_DEPTH) throw new FrameError("nested too deeply");
    const t = this.u8();
    if (t <= 0x7f) return t;
    if (t >= 0xe0) return t - 0x100;
    if ((t & 0xe0) === 0xa0) return this.str(t & 0x1f);
    if ((t & 0xf0) === 0x90) return this.array(t & 0x0f, depth);
    if ((t & 0xf0) === 0x80) return this.map(t & 0x0f, depth);
    switch (t) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return this.bytes(this.uint(1));
      case 0xc5: return this.bytes(this.uint(2));
      case 0xc6: return this.bytes(this.uint(4));
      case 0xca: this.need(4); this.pos += 4; return new F64(this.view.getFloat32(this.pos - 4));
      case 0xcb: this.need(8); this.pos += 8; return new F64(this.view.getFloat64(this.pos - 8));
      case 0xcc: return this.uint(1);
      case 0xcd: return this.uint(2);
      case 0xce: return this.uint(4);
      case 0xcf: { this.need(8); this.pos += 8; return big(this.view.getBigUint64(this.pos - 8)); }
      case 0xd0: this.need(1); this.pos += 1; return this.view.getInt8(this.pos - 1);
      case 0xd1: this.need(2); this.pos += 2; return this.view.getInt16(this.pos - 2);
      case 0xd2: this.need(4); this.pos += 4; return this.view.getInt32(this.pos - 4);
      case 0xd3: { this.need(8); this.pos += 8; return big(this.view.getBigInt64(this.pos - 8)); }
      case 0xd9: return this.str(this.uint(1));
      case 0xda: return this.str(this.uint(2));
      case 0xdb: return this.str(this.uint(4));
      case 0xdc: return this.array(this.uint(2), depth);
      case 0xdd: return this.array(this.uint(4), depth);
      case 0xde: return this.map(this.uint(2), depth);
      case 0xdf: return this.map(this.uint(4), depth);
    }
    if ((t >= 0xd4 && t <= 0xd8) || (t >= 0xc7 && t <= 0xc9)) throw new FrameError("msgpack extension types are not accepted");
    throw new FrameError(`byte 0x${t.toString(16)} is not msgpack`);
  }
  private array(n: number, depth: number): Value[] {
    this.need(n); // every element takes at least one byte
    const out: Value[] = [];
    for (let i = 0; i < n; i++) out.push(this.value(depth + 1));
    return out;
  }
  private map(n: number, depth: number): { [k: string]: Value } {
    this.need(2 * n);
    const out: { [k: string]: Value } = Object.create(null);
    for (let i = 0; i < n; i++) {
      const k = this.value(depth + 1);
      if (typeof k !== "string") throw new FrameError("map keys must be strings");
      if (Object.prototype.hasOwnProperty.call(out, k)) throw new FrameError("duplicate map key");
      out[k] = this.value(depth + 1);
    }
    return out;
  }
}

function big(n: bigint): number | bigint {
  return n >= BigInt(Number.MIN_SAFE_INTEGER) && n <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(n) : n;
}
