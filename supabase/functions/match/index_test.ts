// Runs under `deno test` against a real Postgres with the migrations applied (DB_URL), as
// tests/web/test_edge_functions.py arranges.

import { Authenticator } from "../_shared/auth.ts";
import type { Sql } from "../_shared/caller.ts";
import { assert, assertEquals, connect, hs256, inAnHour, JWT_SECRET, makeUser, MODEL } from "../_shared/testing.ts";
import { createHandler } from "./index.ts";

const SCORE_NODES =
  "public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text)";

type Handler = (r: Request) => Promise<Response>;

async function post(handler: Handler, body: unknown, token?: string): Promise<Response> {
  const headers: Record<string, string> = token ? { authorization: `Bearer ${token}` } : {};
  return await handler(new Request("http://localhost/match", { method: "POST", body: JSON.stringify(body), headers }));
}

async function fleet(sql: Sql): Promise<void> {
  for (const [name, vram, region] of [["small-eu", 24, "eu-west"], ["big-us", 80, "us-east"], ["tiny", 8, "eu-west"]]) {
    const [node] = await sql`
      insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, status, last_heartbeat_at)
      values (${name}, 'NVIDIA L4', ${vram}, 121, 0.45, ${region}, 'online', now()) returning id`;
    await sql`insert into public.node_models (node_id, model_id) values (${node.id}, ${MODEL})`;
  }
}

Deno.test("ranks nodes with score_nodes, explains rejections, refuses bad input", async () => {
  const sql = connect();
  try {
    await fleet(sql);
    const handler = createHandler(sql, new Authenticator({ jwtSecret: JWT_SECRET }));
    const { token } = await makeUser(sql, "owner@example.test");

    const ranked = await post(handler, { model: MODEL, region: "eu-west", limit: 5 }, token);
    assert(ranked.status === 200, `status ${ranked.status}: ${await ranked.clone().text()}`);
    const { data } = await ranked.json();
    assert(data.map((r: { name: string }) => r.name).join(",") === "small-eu,big-us", JSON.stringify(data));
    assert(data[0].rank === "1" || data[0].rank === 1, "ranks start at 1");

    const explained = await (await post(handler, { model: MODEL, explain: true }, token)).json();
    const tiny = explained.data.find((r: { name: string }) => r.name === "tiny");
    assert(tiny.reject_reason === "8 GB VRAM, needs 18 GB", tiny.reject_reason);

    const unknown = await post(handler, { model: "no/such-model" }, token);
    assert(unknown.status === 404, `unknown model: ${unknown.status}`);
    assert((await unknown.json()).error.param === "model", "names the param");
    assert((await post(handler, { model: MODEL, policy: "fancy" }, token)).status === 400, "bad policy");
    assert((await post(handler, { model: MODEL, limit: "five" }, token)).status === 400, "bad limit");
    assert((await post(handler, { model: MODEL, limit: 0 }, token)).status === 400, "limit 0");
    assert((await post(handler, { nope: 1, model: MODEL }, token)).status === 400, "unknown field");
    assert((await post(handler, { nope: 1 }, token)).status === 400, "missing model");
    // From a review: a place off the globe ranked every node NaN (1e999 is Infinity to JSON.parse).
    const raw = (text: string) =>
      handler(new Request("http://localhost/match", { method: "POST", body: text, headers: { authorization: `Bearer ${token}` } }));
    assert((await raw(`{"model": "${MODEL}", "latitude": 1e999, "longitude": 0}`)).status === 400, "latitude Infinity");
    assert((await post(handler, { model: MODEL, latitude: 91, longitude: 0 }, token)).status === 400, "latitude 91");
    assert((await post(handler, { model: MODEL, latitude: 0, longitude: -181 }, token)).status === 400, "longitude -181");
    const notJson = await handler(
      new Request("http://localhost/match", { method: "POST", body: "{", headers: { authorization: `Bearer ${token}` } }),
    );
    assert(notJson.status === 400, "malformed JSON");
    assert((await handler(new Request("http://localhost/match"))).status === 405, "GET");
  } finally {
    await sql.end();
  }
});

Deno.test("signed-in users rank as neuralgrid_matcher, the service as itself, anon not at all", async () => {
  const sql = connect();
  try {
    const handler = createHandler(sql, new Authenticator({ jwtSecret: JWT_SECRET }));
    const anon = await hs256({ role: "anon", iss: "supabase" }); // the legacy anon key
    const service = await hs256({ role: "service_role", iss: "supabase" });
    const { token: user } = await makeUser(sql, "someone@example.test");
    const query = { model: MODEL, limit: 5 };
    const status = async (token: string) => (await post(handler, query, token)).status;

    // No Data API role may call the definer score_nodes() but the service; neuralgrid_matcher may.
    const [granted] = await sql`
      select has_function_privilege('anon', ${SCORE_NODES}, 'execute') as anon,
             has_function_privilege('authenticated', ${SCORE_NODES}, 'execute') as authenticated,
             has_function_privilege('neuralgrid_matcher', ${SCORE_NODES}, 'execute') as matcher,
             has_table_privilege('neuralgrid_matcher', 'public.nodes', 'select') as matcher_reads_nodes`;
    assertEquals(granted, { anon: false, authenticated: false, matcher: true, matcher_reads_nodes: false });
    assertEquals(await status(user), 200, "a signed-in user");
    assertEquals(await status(service), 200, "service_role");
    const refused = await post(handler, query, anon);
    assertEquals(refused.status, 403, "anon");
    assertEquals((await refused.json()).error.code, "forbidden");

    // A user's ranking runs as neuralgrid_matcher: without its grant, the user is refused too.
    await sql.unsafe(`revoke execute on function ${SCORE_NODES} from neuralgrid_matcher`);
    const denied = await post(handler, query, user);
    assertEquals(denied.status, 403, "the user, with the role's grant revoked");
    const message = (await denied.json()).error.message;
    assert(/permission denied for function score_nodes/.test(message), message);
    assertEquals(await status(service), 200, "service_role keeps its own grant");
    await sql.unsafe(`grant execute on function ${SCORE_NODES} to neuralgrid_matcher`);
    assertEquals(await status(user), 200, "the user, granted again");

    // No verified caller, no query: missing, forged, expired, or a role that is not an API role.
    for (
      const [token, why] of [
        [undefined, "no token"],
        [await hs256({ role: "authenticated" }, "not-the-project-secret-but-as-long-as-it"), "another secret"],
        [await hs256({ role: "authenticated", exp: Math.floor(Date.now() / 1000) - 5 }), "expired"],
        [await hs256({ role: "postgres", exp: inAnHour() }), "role postgres"],
      ] as const
    ) {
      const refused = await post(handler, query, token);
      assertEquals(refused.status, 401, why);
      assertEquals((await refused.json()).error.code, "invalid_api_key", why);
    }
  } finally {
    await sql.end();
  }
});
