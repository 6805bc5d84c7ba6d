// The functions accept a caller only with a token or key verified here: HS256 with the JWT secret,
// ES256/RS256 with the project's keys (given, or read from its JWKS with rotation), Supabase's
// opaque keys; never an unsigned, forged, expired or wrongly keyed token, nor a role other than
// Supabase's API roles.

import { Authenticator } from "./auth.ts";
import { HttpError } from "./http.ts";
import { assert, assertEquals, hs256, inAnHour, JWT_SECRET, signingKey, unsigned } from "./testing.ts";

async function refused(auth: Authenticator, token: string, why: RegExp): Promise<void> {
  try {
    const claims = await auth.verify(token);
    throw new Error(`accepted ${JSON.stringify(claims)}`);
  } catch (err) {
    assert(err instanceof HttpError, `not an HTTP answer: ${err}`);
    assertEquals(err.response.status, 401, String(why));
    const body = await err.response.json();
    assertEquals(body.error.type, "invalid_request_error");
    assert(why.test(body.error.message), `${body.error.message} !~ ${why}`);
  }
}

Deno.test("HS256: the JWT secret verifies; forged, expired, unsigned and other roles are refused", async () => {
  const auth = new Authenticator({ jwtSecret: JWT_SECRET });
  const claims = { sub: "0b6f6c1e-8a1e-4c55-9a8e-1d3c1f0e2a11", role: "authenticated", exp: inAnHour() };
  assertEquals(await auth.verify(await hs256(claims)), claims);
  assertEquals((await auth.verify(await hs256({ role: "anon" }))).role, "anon"); // the legacy anon key: no exp

  await refused(auth, await hs256(claims, "another-secret-of-the-same-kind-32-chars"), /signature/);
  const [h, , s] = (await hs256(claims)).split(".");
  const forged = btoa(JSON.stringify({ ...claims, role: "service_role" })).replace(/=+$/, "");
  await refused(auth, `${h}.${forged}.${s}`, /signature|well-formed/);
  await refused(auth, await hs256({ ...claims, exp: Math.floor(Date.now() / 1000) - 1 }), /expired/);
  await refused(auth, await hs256({ ...claims, nbf: inAnHour() }), /not valid yet/);
  await refused(auth, unsigned(claims), /"none" are not accepted/);
  // A valid signature does not make `postgres` (or any owner) a role a function acts as.
  await refused(auth, await hs256({ role: "postgres" }), /role "postgres"/);
  await refused(auth, await hs256({ sub: claims.sub }), /role undefined/);
  await refused(auth, "not-a-token", /neither a JWT/);
  await refused(auth, "a.b.c", /well-formed/);
  // No secret configured: HS256 cannot verify at all.
  await refused(new Authenticator({}), await hs256(claims), /no JWT secret/);
});

Deno.test("ES256 and RS256: the project's keys verify; a token cannot pick another key or algorithm", async () => {
  const ec = await signingKey("ec-1", "ES256");
  const rsa = await signingKey("rsa-1", "RS256");
  const auth = new Authenticator({ jwks: { keys: [ec.publicJwk, rsa.publicJwk] } });
  const claims = { sub: "0b6f6c1e-8a1e-4c55-9a8e-1d3c1f0e2a11", role: "authenticated", exp: inAnHour() };
  assertEquals(await auth.verify(await ec.sign(claims)), claims);
  assertEquals(await auth.verify(await rsa.sign(claims)), claims);

  const stranger = await signingKey("ec-1", "ES256"); // same kid, another key: a forger's
  await refused(auth, await stranger.sign(claims), /signature/);
  await refused(auth, await ec.sign(claims, { kid: "ec-2" }), /not in the project's signing keys/);
  await refused(auth, await ec.sign(claims, { kid: undefined }), /without a key id/);
  await refused(auth, await rsa.sign(claims, { kid: "ec-1", alg: "RS256" }), /not an RS256 key/);
  // HS256 with the public key as the "secret" (the classic confusion): no symmetric key here.
  await refused(auth, await hs256(claims, JSON.stringify(ec.publicJwk), { kid: "ec-1" }), /no JWT secret/);
});

Deno.test("the project's JWKS is read once, again for a new key id (at most every refetchMs), kept if Auth is away", async () => {
  const first = await signingKey("k1");
  const second = await signingKey("k2");
  let published = [first.publicJwk];
  let fetches = 0;
  let down = false;
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, (req) => {
    fetches++;
    assertEquals(new URL(req.url).pathname, "/auth/v1/.well-known/jwks.json");
    return down ? new Response("unavailable", { status: 503 }) : Response.json({ keys: published });
  });
  try {
    let now = 1_000_000;
    const auth = new Authenticator({
      jwksUrl: `http://127.0.0.1:${server.addr.port}/auth/v1/.well-known/jwks.json`,
      ttlMs: 600_000,
      refetchMs: 30_000,
      now: () => now,
    });
    const claims = { role: "authenticated", sub: "0b6f6c1e-8a1e-4c55-9a8e-1d3c1f0e2a11" };
    await auth.verify(await first.sign(claims));
    await auth.verify(await first.sign(claims));
    assertEquals(fetches, 1, "read on first use, then cached");

    // A rotation: k2 is published, and a token signed with it makes the function read the set again.
    published = [first.publicJwk, second.publicJwk];
    now += 1_000;
    await auth.verify(await second.sign(claims));
    assertEquals(fetches, 2, "an unseen key id is looked up");
    // Made-up key ids cannot make it hammer Auth: one look-up per refetchMs.
    const madeUp = async (kid: string) =>
      await refused(auth, await (await signingKey(kid)).sign(claims), /not in the project's signing keys/);
    await madeUp("made-up-1");
    await madeUp("made-up-2");
    assertEquals(fetches, 2, "no look-up within refetchMs of the last");
    now += 30_000;
    await madeUp("made-up-3");
    await madeUp("made-up-4");
    assertEquals(fetches, 3, "one look-up for unknown key ids per refetchMs");

    // Auth away when the cache expires: the keys already read stay in use.
    down = true;
    now += 700_000;
    await auth.verify(await first.sign(claims));
    assertEquals(fetches, 4);
  } finally {
    await server.shutdown();
  }
});

Deno.test("Supabase's API keys stand for anon and service_role; the request's headers are read as PostgREST does", async () => {
  const env = new Map([
    ["SUPABASE_PUBLISHABLE_KEYS", JSON.stringify({ default: "sb_publishable_abc" })],
    ["SUPABASE_SECRET_KEYS", JSON.stringify({ default: "sb_secret_xyz" })],
    ["JWT_SECRET", JWT_SECRET],
    ["SUPABASE_JWKS", JSON.stringify({ keys: [] })],
  ]);
  const auth = Authenticator.fromEnv({ get: (name) => env.get(name) });
  assertEquals(await auth.verify("sb_publishable_abc"), { role: "anon" });
  assertEquals(await auth.verify("sb_secret_xyz"), { role: "service_role" });
  await refused(auth, "sb_publishable_abd", /not one of the project's/);
  await refused(auth, "sb_secret_", /not one of the project's/);

  const request = (headers: Record<string, string>) => new Request("http://localhost/", { headers });
  const user = await hs256({ role: "authenticated", sub: "0b6f6c1e-8a1e-4c55-9a8e-1d3c1f0e2a11" });
  // supabase-js sends both: the user's token wins over the apikey.
  assertEquals((await auth.caller(request({ apikey: "sb_publishable_abc", authorization: `Bearer ${user}` }))).role, "authenticated");
  assertEquals((await auth.caller(request({ apikey: "sb_publishable_abc" }))).role, "anon");
  try {
    await auth.caller(request({}));
    throw new Error("no credentials accepted");
  } catch (err) {
    assert(err instanceof HttpError && err.response.status === 401, String(err));
    assertEquals(err.response.headers.get("www-authenticate"), "Bearer");
  }
});
