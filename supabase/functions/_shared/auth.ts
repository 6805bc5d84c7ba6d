// Who is calling: the claims of the caller's Supabase JWT, verified here, or the role an opaque
// Supabase API key stands for. The functions act as that role in the database (see caller.ts), so
// a token is accepted only if this module verified its signature itself: the platform's own
// `verify_jwt` check is off (it cannot verify tokens signed with a project's asymmetric keys, nor
// read `sb_publishable_…` keys), and a token whose signature was not checked here could claim any
// role.
//
// Keys, as the gateway reads them (neuralgrid/server/tokens.py):
// - HS256 with the legacy JWT secret (`JWT_SECRET`, a secret you set, or `SUPABASE_JWT_SECRET`
//   where the runtime provides it), and with symmetric (`oct`) keys in SUPABASE_JWKS;
// - ES256 and RS256 with the project's signing keys: SUPABASE_JWKS (set for every function on
//   Supabase), else `<SUPABASE_URL>/auth/v1/.well-known/jwks.json`, read on first use, again after
//   ten minutes, and at once for a key id not seen yet (a rotation), at most every 30 s.
// - `sb_publishable_…` keys (SUPABASE_PUBLISHABLE_KEYS) stand for anon, `sb_secret_…` keys
//   (SUPABASE_SECRET_KEYS) for service_role, as they do for Supabase's Data API.

import { error, HttpError } from "./http.ts";

/** The roles a function may act as: Supabase's API roles, never `postgres` or another owner. */
export const ROLES = ["anon", "authenticated", "service_role"] as const;
export type Role = typeof ROLES[number];

/** A verified caller: the JWT's claims (at least its role), as PostgREST sets request.jwt.claims. */
export interface Claims {
  role: Role;
  sub?: string;
  [claim: string]: unknown;
}

export interface AuthConfig {
  /** The legacy HS256 JWT secret. */
  jwtSecret?: string;
  /** A JSON Web Key Set given to the function (SUPABASE_JWKS): verifies without a fetch. */
  jwks?: unknown;
  /** Where the project publishes its signing keys, read when a token's key is not in `jwks`. */
  jwksUrl?: string;
  /** Opaque keys for anon (`sb_publishable_…`) and service_role (`sb_secret_…`). */
  publishableKeys?: string[];
  secretKeys?: string[];
  ttlMs?: number;
  refetchMs?: number;
  fetch?: typeof fetch;
  now?: () => number;
}

interface VerifyingKey {
  alg: "HS256" | "ES256" | "RS256";
  kid?: string;
  key: CryptoKey;
}

const IMPORT: Record<VerifyingKey["alg"], RsaHashedImportParams | EcKeyImportParams | HmacImportParams> = {
  HS256: { name: "HMAC", hash: "SHA-256" },
  ES256: { name: "ECDSA", namedCurve: "P-256" },
  RS256: { name: "RSASSA-PKCS1-v1_5", hash: "SHA-256" },
};
const VERIFY: Record<VerifyingKey["alg"], AlgorithmIdentifier | EcdsaParams> = {
  HS256: "HMAC",
  ES256: { name: "ECDSA", hash: "SHA-256" },
  RS256: "RSASSA-PKCS1-v1_5",
};

function unauthorized(message: string): HttpError {
  return new HttpError(error(401, message));
}

function base64url(text: string): Uint8Array<ArrayBuffer> {
  if (!/^[A-Za-z0-9_-]*$/.test(text)) throw new Error("not base64url");
  const padded = text.replace(/-/g, "+").replace(/_/g, "/") + "=".repeat((4 - (text.length % 4)) % 4);
  return Uint8Array.from(atob(padded), (c) => c.charCodeAt(0));
}

function sameText(a: string, b: string): boolean {
  // Constant time for equal lengths; a key's length is no secret.
  if (a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a.charCodeAt(i) ^ b.charCodeAt(i);
  return diff === 0;
}

/** The verifying keys of a JWKS document; keys of other kinds, uses or algorithms are skipped.
 * `symmetric`: also HS256 (`oct`) keys, accepted only from a set handed to the function, never
 * from one read over the network. */
export async function importJwks(document: unknown, symmetric: boolean): Promise<VerifyingKey[]> {
  const keys = (document as { keys?: unknown })?.keys;
  if (!Array.isArray(keys)) throw new Error("a JWKS document is an object with a 'keys' list");
  const found: VerifyingKey[] = [];
  for (const jwk of keys as Record<string, unknown>[]) {
    if (typeof jwk !== "object" || jwk === null || (jwk.use !== undefined && jwk.use !== "sig")) continue;
    const alg = jwk.alg ?? { EC: "ES256", RSA: "RS256", oct: "HS256" }[String(jwk.kty)];
    const kty = { ES256: "EC", RS256: "RSA", HS256: "oct" }[String(alg)];
    if (kty === undefined || jwk.kty !== kty || (alg === "HS256" && !symmetric)) continue;
    if (alg !== "HS256" && jwk.d !== undefined) continue; // a private key has no place in a key set
    const kid = typeof jwk.kid === "string" ? jwk.kid : undefined;
    if (alg !== "HS256" && kid === undefined) continue;
    // Only the public members (or the secret of an oct key): key_ops or ext could forbid "verify".
    const members = { ES256: ["kty", "crv", "x", "y"], RS256: ["kty", "n", "e"], HS256: ["kty", "k"] }[
      alg as VerifyingKey["alg"]
    ];
    const bare = Object.fromEntries(members.map((m) => [m, jwk[m]])) as JsonWebKey;
    try {
      const key = await crypto.subtle.importKey("jwk", bare, IMPORT[alg as VerifyingKey["alg"]], false, ["verify"]);
      found.push({ alg: alg as VerifyingKey["alg"], kid, key });
    } catch {
      continue; // a malformed key verifies nothing; the others still do
    }
  }
  return found;
}

function keyList(value: string | undefined): string[] {
  if (!value) return [];
  try {
    const parsed = JSON.parse(value);
    if (typeof parsed === "string") return [parsed];
    if (typeof parsed === "object" && parsed !== null) {
      return Object.values(parsed).filter((k): k is string => typeof k === "string");
    }
  } catch {
    // not JSON: a single key
  }
  return [value];
}

export class Authenticator {
  private readonly config: AuthConfig;
  private static_: Promise<VerifyingKey[]> | undefined;
  private fetched: VerifyingKey[] = [];
  private freshUntil = -Infinity;
  private lookedForKid = -Infinity;
  private refreshing: Promise<void> | undefined;

  constructor(config: AuthConfig) {
    this.config = config;
  }

  /** As deployed: the keys Supabase gives every Edge Function (see the top of this file). */
  static fromEnv(env: { get(name: string): string | undefined } = Deno.env): Authenticator {
    const url = env.get("SUPABASE_URL");
    const jwks = env.get("SUPABASE_JWKS");
    return new Authenticator({
      jwtSecret: env.get("JWT_SECRET") || env.get("SUPABASE_JWT_SECRET") || undefined,
      jwks: jwks ? JSON.parse(jwks) : undefined,
      jwksUrl: url ? `${url.replace(/\/+$/, "")}/auth/v1/.well-known/jwks.json` : undefined,
      publishableKeys: keyList(env.get("SUPABASE_PUBLISHABLE_KEYS")),
      secretKeys: keyList(env.get("SUPABASE_SECRET_KEYS")),
    });
  }

  /** The caller's claims from `Authorization: Bearer <JWT or key>`, else from `apikey`;
   * HttpError 401 when neither is there or verifies. */
  async caller(req: Request): Promise<Claims> {
    const header = req.headers.get("authorization") ?? "";
    const bearer = /^bearer\s+(\S+)\s*$/i.exec(header)?.[1];
    const token = bearer ?? req.headers.get("apikey")?.trim();
    if (!token) {
      throw unauthorized("send a Supabase JWT or API key: 'Authorization: Bearer <token>'");
    }
    return await this.verify(token);
  }

  /** The claims a JWT or opaque API key carries, verified; HttpError 401 otherwise. */
  async verify(token: string): Promise<Claims> {
    if (token.startsWith("sb_")) return this.opaque(token);
    const parts = token.split(".");
    if (parts.length !== 3) throw unauthorized("the token is neither a JWT nor a Supabase API key");
    let header: Record<string, unknown>;
    let payload: Record<string, unknown>;
    let signature: Uint8Array<ArrayBuffer>;
    try {
      header = JSON.parse(new TextDecoder().decode(base64url(parts[0])));
      payload = JSON.parse(new TextDecoder().decode(base64url(parts[1])));
      signature = base64url(parts[2]);
    } catch {
      throw unauthorized("the token is not a well-formed JWT");
    }
    if (typeof payload !== "object" || payload === null || Array.isArray(payload)) {
      throw unauthorized("the token's claims are not a JSON object");
    }
    const data = new TextEncoder().encode(`${parts[0]}.${parts[1]}`);
    const candidates = await this.keysFor(header);
    let valid = false;
    for (const candidate of candidates) {
      if (candidate.alg === "ES256" && signature.byteLength !== 64) continue;
      if (await crypto.subtle.verify(VERIFY[candidate.alg], candidate.key, signature, data)) {
        valid = true;
        break;
      }
    }
    if (!valid) throw unauthorized("the token's signature does not verify");
    const now = (this.config.now ?? Date.now)() / 1000;
    if (payload.exp !== undefined && !(typeof payload.exp === "number" && now < payload.exp)) {
      throw unauthorized("the token has expired");
    }
    if (payload.nbf !== undefined && !(typeof payload.nbf === "number" && now >= payload.nbf)) {
      throw unauthorized("the token is not valid yet");
    }
    if (!(ROLES as readonly unknown[]).includes(payload.role)) {
      throw unauthorized(`a token for the role ${JSON.stringify(payload.role)}: functions act as ${ROLES.join(", ")}`);
    }
    return payload as Claims;
  }

  private opaque(token: string): Claims {
    // Every configured key is compared, so the time taken says nothing about which matched.
    const anon = (this.config.publishableKeys ?? []).map((k) => sameText(k, token)).includes(true);
    const service = (this.config.secretKeys ?? []).map((k) => sameText(k, token)).includes(true);
    if (service) return { role: "service_role" };
    if (anon) return { role: "anon" };
    throw unauthorized("this API key is not one of the project's");
  }

  private async keysFor(header: Record<string, unknown>): Promise<VerifyingKey[]> {
    const alg = header.alg;
    const kid = typeof header.kid === "string" ? header.kid : undefined;
    if (alg === "HS256") {
      const keys = [...(await this.staticKeys())].filter((k) => k.alg === "HS256");
      // A kid names one of SUPABASE_JWKS's symmetric keys; without one, any of them (or the secret).
      const named = keys.filter((k) => kid !== undefined && k.kid === kid);
      const candidates = named.length ? named : keys;
      if (!candidates.length) throw unauthorized("an HS256 token, but no JWT secret is configured (JWT_SECRET)");
      return candidates;
    }
    if (alg !== "ES256" && alg !== "RS256") {
      throw unauthorized(`tokens signed with ${JSON.stringify(alg)} are not accepted (HS256, ES256 or RS256)`);
    }
    if (kid === undefined) throw unauthorized(`an ${alg} token without a key id (kid)`);
    const known = (await this.staticKeys()).filter((k) => k.kid === kid);
    if (!known.length && this.config.jwksUrl) {
      const now = (this.config.now ?? Date.now)();
      const missing = !this.fetched.some((k) => k.kid === kid);
      if (now >= this.freshUntil || (missing && now - this.lookedForKid >= (this.config.refetchMs ?? 30_000))) {
        if (missing && now < this.freshUntil) this.lookedForKid = now;
        await this.refresh();
      }
      known.push(...this.fetched.filter((k) => k.kid === kid));
    }
    if (!known.length) throw unauthorized(`key id ${JSON.stringify(kid)} is not in the project's signing keys`);
    const matching = known.filter((k) => k.alg === alg);
    if (!matching.length) throw unauthorized(`key ${JSON.stringify(kid)} is not an ${alg} key`);
    return matching;
  }

  private staticKeys(): Promise<VerifyingKey[]> {
    this.static_ ??= (async () => {
      const keys = this.config.jwks === undefined ? [] : await importJwks(this.config.jwks, true);
      if (this.config.jwtSecret) {
        const raw = new TextEncoder().encode(this.config.jwtSecret);
        keys.push({ alg: "HS256", key: await crypto.subtle.importKey("raw", raw, IMPORT.HS256, false, ["verify"]) });
      }
      return keys;
    })();
    return this.static_;
  }

  private refresh(): Promise<void> {
    // One fetch at a time: callers that arrive meanwhile wait for it.
    this.refreshing ??= this.fetchKeys().finally(() => {
      this.refreshing = undefined;
    });
    return this.refreshing;
  }

  private async fetchKeys(): Promise<void> {
    const now = (this.config.now ?? Date.now)();
    try {
      const response = await (this.config.fetch ?? fetch)(this.config.jwksUrl!, {
        headers: { accept: "application/json" },
        signal: AbortSignal.timeout(5_000),
      });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      this.fetched = await importJwks(await response.json(), false);
      this.freshUntil = now + (this.config.ttlMs ?? 600_000);
    } catch (err) {
      // Keep the keys already read (Auth briefly away must not sign everyone out); try again no
      // sooner than refetchMs.
      this.freshUntil = now + (this.config.refetchMs ?? 30_000);
      if (!this.fetched.length) {
        throw new HttpError(error(503, `the project's signing keys could not be read: ${(err as Error).message}`));
      }
    }
  }
}
