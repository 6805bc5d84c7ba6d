// The node heartbeat function against a migrated Postgres (DB_URL): a node registered with
// register_node() keeps itself alive with its secret; a wrong secret, a missing one or a bad body
// changes nothing; and the function acts as neuralgrid_node, so that role's grants decide what it can do.

import type { Sql } from "../_shared/caller.ts";
import { assert, assertEquals, connect, MODEL } from "../_shared/testing.ts";
import { createHandler, MAX_BODY_BYTES } from "./index.ts";

const QWEN = "Qwen/Qwen2.5-0.5B-Instruct";
const BY_SECRET =
  "public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb)";

type Handler = (r: Request) => Promise<Response>;

/** A node as the gateway registers one (register_node(), service side), plus its secret. */
async function register(sql: Sql, name: string): Promise<{ id: string; secret: string }> {
  const [row] = await sql`
    select node_id, node_secret from public.register_node(
      null, ${name}, 'NVIDIA L4', 1, 24, 121, 0.45, 'eu-west', 52.37, 4.9, 'https://node.example.test/', 4,
      ${[MODEL]}::text[], '0.9.0', null, '{"kind": "vllm"}'::jsonb)`;
  // As the sweeper leaves a silent node: offline, its last beat a minute ago.
  await sql`update public.nodes set status = 'offline', last_heartbeat_at = now() - interval '1 minute'
            where id = ${row.node_id}`;
  return { id: row.node_id, secret: row.node_secret };
}

/** What a heartbeat may change, to compare before and after. */
async function state(sql: Sql, id: string): Promise<string> {
  const [node] = await sql`
    select n.status, n.queue_depth, n.gpu_utilization, n.free_vram_gb, n.last_heartbeat_at, n.backend,
           n.backend_up, n.vram_gb,
           (select array_agg(nm.model_id || ':' || nm.state order by nm.model_id) from public.node_models nm
            where nm.node_id = n.id) as models
    from public.nodes n where n.id = ${id}`;
  return JSON.stringify(node);
}

async function beat(handler: Handler, id: string, secret: string | null, body: unknown, path?: string): Promise<Response> {
  const headers: Record<string, string> = secret === null ? {} : { authorization: `Bearer ${secret}` };
  const raw = typeof body === "string" ? body : JSON.stringify(body);
  return await handler(
    new Request(`http://localhost${path ?? `/heartbeat/${id}`}`, { method: "POST", body: raw, headers }),
  );
}

Deno.test("a node's heartbeat brings it online and records its load, models, specs and server", async () => {
  const sql = connect();
  try {
    const handler = createHandler(sql);
    const node = await register(sql, "edge-node");
    const reply = await beat(handler, node.id, node.secret, {
      status: "online",
      queue_depth: 3,
      gpu_utilization: 0.5,
      free_vram_gb: 12.5,
      models: [MODEL, QWEN, MODEL],
      specs: { gpu_model: "NVIDIA L4", gpu_count: 1, vram_gb: 23.5, tflops: 121 },
      backend: { kind: "vllm", version: "0.6.3", parallel: 8, routes: ["chat/completions", "embeddings"] },
      available: [MODEL, QWEN, "meta-llama/Llama-3.2-3B-Instruct"],
    });
    assertEquals(reply.status, 200, await reply.clone().text());
    assertEquals(await reply.json(), { node_id: node.id, status: "online", load: [] });
    const [row] = await sql`
      select status, queue_depth, gpu_utilization, free_vram_gb, vram_gb, backend,
             last_heartbeat_at > now() - interval '5 seconds' as fresh
      from public.nodes where id = ${node.id}`;
    assertEquals(row, {
      status: "online",
      queue_depth: 3,
      gpu_utilization: 0.5,
      free_vram_gb: 12.5,
      vram_gb: 23.5,
      // The whole server description, with the gateway's defaults, as the gateway stores it.
      backend: {
        kind: "vllm",
        echoes: false,
        routes: ["chat/completions", "embeddings"],
        version: "0.6.3",
        parallel: 8,
        tokenize: false,
        continues: false,
        interrupts: false,
        usage_in_streams: false,
      },
      fresh: true,
    });
    const models = await sql`select model_id, state from public.node_models where node_id = ${node.id} order by 1`;
    assertEquals(models.map((m) => `${m.model_id}:${m.state}`), [
      "Qwen/Qwen2.5-0.5B-Instruct:loaded",
      "meta-llama/Llama-3.1-8B-Instruct:loaded",
      "meta-llama/Llama-3.2-3B-Instruct:available",
    ]);

    // Draining, through the agent's own path (its gateway URL set to the function's).
    const draining = await beat(handler, node.id, node.secret, { status: "draining", models: [MODEL] }, `/heartbeat/v1/nodes/${node.id}/heartbeat`);
    assertEquals(await draining.json(), { node_id: node.id, status: "draining", load: [] });
    // A dead server behind a live agent: offline, nothing warm.
    const dead = await beat(handler, node.id, node.secret, { models: [MODEL], backend_up: false });
    assertEquals((await dead.json()).status, "offline");
    assertEquals((await sql`select backend_up from public.nodes where id = ${node.id}`)[0].backend_up, false);
  } finally {
    await sql.end();
  }
});

Deno.test("a wrong or missing secret, another node's secret or an unknown node: refused, nothing changes", async () => {
  const sql = connect();
  try {
    const handler = createHandler(sql);
    const node = await register(sql, "victim");
    const other = await register(sql, "other");
    const before = await state(sql, node.id);
    const body = { status: "online", queue_depth: 7, models: [QWEN] };

    for (
      const [secret, why] of [
        [node.secret.slice(0, -1) + (node.secret.endsWith("0") ? "1" : "0"), "one character off"],
        [other.secret, "another node's secret"],
        ["ngn-", "a prefix"],
      ] as const
    ) {
      const refused = await beat(handler, node.id, secret, body);
      assertEquals(refused.status, 401, why);
      const error = (await refused.json()).error;
      assertEquals([error.type, error.code], ["invalid_request_error", "invalid_api_key"], why);
      assert(/does not belong to node/.test(error.message), error.message);
    }
    const missing = await beat(handler, node.id, null, body);
    assertEquals(missing.status, 401, "no Authorization");
    assertEquals(missing.headers.get("www-authenticate"), "Bearer");
    assertEquals(await state(sql, node.id), before, "the refused beats changed nothing");

    const unknown = await beat(handler, crypto.randomUUID(), node.secret, body);
    assertEquals(unknown.status, 404);
    assertEquals((await unknown.json()).error.param, "node_id");
    assertEquals((await beat(handler, "", node.secret, body, "/heartbeat/not-a-node")).status, 404, "no node id");
    assertEquals(await state(sql, node.id), before);
  } finally {
    await sql.end();
  }
});

Deno.test("bad bodies: OpenAI-shaped 4xx naming the parameter, nothing stored", async () => {
  const sql = connect();
  try {
    const handler = createHandler(sql);
    const node = await register(sql, "careful");
    const before = await state(sql, node.id);
    const cases: [unknown, number, string | null][] = [
      ["{", 400, null],
      ["", 400, null],
      [[], 400, null],
      ["null", 400, null],
      [{ models: [MODEL], nope: 1 }, 400, "nope"],
      [{ status: "busy" }, 400, "status"],
      [{ status: null }, 400, "status"],
      [{ queue_depth: -1 }, 400, "queue_depth"],
      [{ queue_depth: 1.5 }, 400, "queue_depth"],
      [{ queue_depth: "3" }, 400, "queue_depth"],
      [{ gpu_utilization: 1.5 }, 400, "gpu_utilization"],
      [{ models: MODEL }, 400, "models"],
      [{ models: [""] }, 400, "models.0"],
      [{ models: [MODEL, "bad\u0000name"] }, 400, "models.1"],
      [{ models: Array.from({ length: 1001 }, (_, i) => `m${i}`) }, 400, "models"],
      [{ specs: { gpu_model: "L4", gpu_count: 1, vram_gb: 24 } }, 400, "specs.tflops"],
      [{ specs: { gpu_model: "L4", gpu_count: 1, vram_gb: 0, tflops: 1 } }, 400, "specs.vram_gb"],
      [{ backend: { version: "1" } }, 400, "backend.kind"],
      [{ backend: { kind: "vllm", routes: ["chat/completions", "v1/teleport"] } }, 400, "backend.routes.1"],
      [{ backend: { kind: "vllm", routes: [] } }, 400, "backend.routes"],
      [{ backend_up: "yes" }, 400, "backend_up"],
      [{ refused: [{ model: MODEL }] }, 400, "refused.0.reason"],
      [{ loaded: Array.from({ length: 17 }, () => MODEL) }, 400, "loaded"],
      ["x".repeat(MAX_BODY_BYTES + 1), 413, null],
    ];
    for (const [body, status, param] of cases) {
      const why = JSON.stringify(body).slice(0, 80);
      const refused = await beat(handler, node.id, node.secret, body);
      assertEquals(refused.status, status, why);
      const error = (await refused.json()).error;
      assertEquals([error.type, error.param], ["invalid_request_error", param], why);
      assert(typeof error.message === "string" && error.message.length > 0, why);
    }
    const get = await handler(
      new Request(`http://localhost/heartbeat/${node.id}`, { headers: { authorization: `Bearer ${node.secret}` } }),
    );
    assertEquals(get.status, 405);
    assertEquals(await state(sql, node.id), before, "no refused body changed anything");

    // The empty heartbeat is the gateway's defaults: online, idle, nothing warm.
    const empty = await beat(handler, node.id, node.secret, {});
    assertEquals((await empty.json()).status, "online");
  } finally {
    await sql.end();
  }
});

Deno.test("it acts as neuralgrid_node: only that role's grant on agent_heartbeat_with_secret() lets it through", async () => {
  const sql = connect();
  try {
    const handler = createHandler(sql);
    const node = await register(sql, "granted");
    const [grants] = await sql`
      select has_function_privilege('neuralgrid_node', ${BY_SECRET}, 'execute') as by_secret,
             has_function_privilege('anon', ${BY_SECRET}, 'execute') as by_secret_anon,
             has_function_privilege('authenticated', ${BY_SECRET}, 'execute') as by_secret_authenticated,
             has_function_privilege('neuralgrid_node', 'public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb)', 'execute') as by_hash,
             has_column_privilege('neuralgrid_node', 'public.nodes', 'secret_hash', 'select') as reads_hash,
             has_table_privilege('neuralgrid_node', 'public.nodes', 'update') as updates_nodes`;
    assertEquals(grants, {
      by_secret: true,
      by_secret_anon: false,
      by_secret_authenticated: false,
      by_hash: false,
      reads_hash: false,
      updates_nodes: false,
    });

    await sql.unsafe(`revoke execute on function ${BY_SECRET} from neuralgrid_node`);
    const before = await state(sql, node.id);
    const denied = await beat(handler, node.id, node.secret, { models: [MODEL] });
    assertEquals(denied.status, 403, "the role without the grant");
    assertEquals((await denied.json()).error.code, "forbidden");
    assertEquals(await state(sql, node.id), before, "nothing changed");

    await sql.unsafe(`grant execute on function ${BY_SECRET} to neuralgrid_node`);
    const allowed = await beat(handler, node.id, node.secret, { models: [MODEL] });
    assertEquals(allowed.status, 200, "the role with the grant");

    // Through the Data API (as anon, with the publishable key) there is no way in, secret or not.
    const asAnon = (secret: string) =>
      sql.begin(async (tx) => {
        await tx`select set_config('role', 'anon', true)`;
        return await tx`select status from public.agent_heartbeat_with_secret(${node.id}::uuid, ${secret}, 'online', 0)`;
      });
    let code: string | undefined;
    await asAnon(node.secret).catch((err) => (code = err.code));
    assertEquals(code, "42501", "anon cannot call it, even with the node's secret");
  } finally {
    await sql.end();
  }
});
