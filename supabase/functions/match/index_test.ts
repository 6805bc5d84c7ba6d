// Runs under `deno test` against a real Postgres with the migrations applied (DB_URL), as
// tests/test_edge_functions.py arranges.
import postgres from "postgres";
import { createHandler } from "./index.ts";

const MODEL = "meta-llama/Llama-3.1-8B-Instruct";

function assert(condition: unknown, message: string): asserts condition {
  if (!condition) throw new Error(message);
}

async function post(handler: (r: Request) => Promise<Response>, body: unknown): Promise<Response> {
  return await handler(new Request("http://localhost/match", { method: "POST", body: JSON.stringify(body) }));
}

Deno.test("ranks nodes with score_nodes, explains rejections, refuses bad input", async () => {
  const sql = postgres(Deno.env.get("DB_URL")!, { prepare: false, onnotice: () => {} });
  try {
    for (const [name, vram, region] of [["small-eu", 24, "eu-west"], ["big-us", 80, "us-east"], ["tiny", 8, "eu-west"]]) {
      const [node] = await sql`
        insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, status, last_heartbeat_at)
        values (${name}, 'NVIDIA L4', ${vram}, 121, 0.45, ${region}, 'online', now()) returning id`;
      await sql`insert into public.node_models (node_id, model_id) values (${node.id}, ${MODEL})`;
    }
    const handler = createHandler(sql);

    const ranked = await post(handler, { model: MODEL, region: "eu-west", limit: 5 });
    assert(ranked.status === 200, `status ${ranked.status}`);
    const { data } = await ranked.json();
    assert(data.map((r: { name: string }) => r.name).join(",") === "small-eu,big-us", JSON.stringify(data));
    assert(data[0].rank === "1" || data[0].rank === 1, "ranks start at 1");

    const explained = await (await post(handler, { model: MODEL, explain: true })).json();
    const tiny = explained.data.find((r: { name: string }) => r.name === "tiny");
    assert(tiny.reject_reason === "8 GB VRAM, needs 18 GB", tiny.reject_reason);

    const unknown = await post(handler, { model: "no/such-model" });
    assert(unknown.status === 404, `unknown model: ${unknown.status}`);
    assert((await unknown.json()).error.param === "model", "names the param");
    assert((await post(handler, { model: MODEL, policy: "fancy" })).status === 400, "bad policy");
    assert((await post(handler, { model: MODEL, limit: "five" })).status === 400, "bad limit");
    assert((await post(handler, { nope: 1 })).status === 400, "missing model");
    const notJson = await handler(new Request("http://localhost/match", { method: "POST", body: "{" }));
    assert(notJson.status === 400, "malformed JSON");
    assert((await handler(new Request("http://localhost/match"))).status === 405, "GET");
  } finally {
    await sql.end();
  }
});
