// Helpers for the functions' Deno tests (tests/web/test_edge_functions.py runs each *_test.ts file
// against its own migrated embedded Postgres, DB_URL, connected as `postgres` as SUPABASE_DB_URL is).

import postgres from "postgres";
import type { Sql } from "./caller.ts";

export const MODEL = "meta-llama/Llama-3.1-8B-Instruct";
export const JWT_SECRET = "a-test-jwt-secret-at-least-32-characters-long";

export function assert(condition: unknown, message: string): asserts condition {
  if (!condition) throw new Error(message);
}

export function assertEquals(actual: unknown, expected: unknown, message = ""): void {
  const [a, e] = [JSON.stringify(actual), JSON.stringify(expected)];
  if (a !== e) throw new Error(`${message}${message ? ": " : ""}${a} !== ${e}`);
}

/** `max`: connections in the pool (1: every query on one connection, to see what it keeps). */
export function connect(max = 4): Sql {
  const url = Deno.env.get("DB_URL");
  assert(url, "DB_URL: run these tests with tests/web/test_edge_functions.py");
  return postgres(url, { prepare: false, onnotice: () => {}, max });
}

function base64url(bytes: Uint8Array | string): string {
  const raw = typeof bytes === "string" ? new TextEncoder().encode(bytes) : bytes;
  return btoa(String.fromCharCode(...raw)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** A JWT signed with `sign` (or unsigned, for alg none). */
async function jwt(
  header: Record<string, unknown>,
  claims: Record<string, unknown>,
  sign: (data: Uint8Array<ArrayBuffer>) => Promise<ArrayBuffer>,
): Promise<string> {
  const body = `${base64url(JSON.stringify(header))}.${base64url(JSON.stringify(claims))}`;
  return `${body}.${base64url(new Uint8Array(await sign(new TextEncoder().encode(body))))}`;
}

export const inAnHour = () => Math.floor(Date.now() / 1000) + 3600;

/** An HS256 token, as Supabase Auth signs with the legacy JWT secret. */
export async function hs256(
  claims: Record<string, unknown>,
  secret = JWT_SECRET,
  header: Record<string, unknown> = {},
): Promise<string> {
  const key = await crypto.subtle.importKey(
    "raw",
    new TextEncoder().encode(secret),
    { name: "HMAC", hash: "SHA-256" },
    false,
    ["sign"],
  );
  return await jwt({ alg: "HS256", typ: "JWT", ...header }, claims, (data) => crypto.subtle.sign("HMAC", key, data));
}

export interface SigningKey {
  kid: string;
  alg: "ES256" | "RS256";
  publicJwk: JsonWebKey & { kid: string; alg: string; use: string };
  sign(claims: Record<string, unknown>, header?: Record<string, unknown>): Promise<string>;
}

/** An asymmetric signing key, as a project's JWT signing keys are; its public half as a JWK. */
export async function signingKey(kid: string, alg: "ES256" | "RS256" = "ES256"): Promise<SigningKey> {
  const params = alg === "ES256"
    ? { name: "ECDSA", namedCurve: "P-256" }
    : { name: "RSASSA-PKCS1-v1_5", modulusLength: 2048, publicExponent: new Uint8Array([1, 0, 1]), hash: "SHA-256" };
  const pair = await crypto.subtle.generateKey(params, true, ["sign", "verify"]) as CryptoKeyPair;
  const publicJwk = { ...(await crypto.subtle.exportKey("jwk", pair.publicKey)), kid, alg, use: "sig" };
  const signParams = alg === "ES256" ? { name: "ECDSA", hash: "SHA-256" } : "RSASSA-PKCS1-v1_5";
  return {
    kid,
    alg,
    publicJwk,
    sign: (claims, header = {}) =>
      jwt({ alg, typ: "JWT", kid, ...header }, claims, (data) => crypto.subtle.sign(signParams, pair.privateKey, data)),
  };
}

/** An unsigned token (alg none), which nothing may accept. */
export function unsigned(claims: Record<string, unknown>): string {
  return `${base64url(JSON.stringify({ alg: "none", typ: "JWT" }))}.${base64url(JSON.stringify(claims))}.`;
}

/** A user in auth.users (as Supabase Auth adds one) and their access token's claims. */
export async function makeUser(sql: Sql, email: string): Promise<{ id: string; token: string }> {
  const [user] = await sql`insert into auth.users (email) values (${email}) returning id`;
  const token = await hs256({ sub: user.id, role: "authenticated", aud: "authenticated", email, exp: inAnHour() });
  return { id: user.id, token };
}
