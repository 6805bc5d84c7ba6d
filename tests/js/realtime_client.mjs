// Run with `node --experimental-websocket` on Node 20 (22+ has WebSocket built in).
// A supabase-js (realtime-js, vsn 2.0.0) subscriber for tests/test_realtime_js.py.
// argv: <supabase url> <anon key> <user token> <owner id of someone else's node>
// Prints one JSON object per line: {"ready": ...} once subscribed, then every event it receives.
// Reads commands from stdin, one JSON object per line: {"broadcast": {...}} sends one.
import { createClient } from "@supabase/supabase-js";
import readline from "node:readline";

const [url, anonKey, userToken, otherOwner] = process.argv.slice(2);
const say = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
const supabase = createClient(url, anonKey, { auth: { persistSession: false, autoRefreshToken: false } });

function subscribed(channel) {
  return new Promise((resolve) => channel.subscribe((status, err) => {
    if (status !== "SUBSCRIBED" || err) say({ status: channel.topic, value: status, error: err ? String(err.message) : null });
    if (status !== "JOINING") resolve(status);
  }));
}

const map = supabase
  .channel("node-map", { config: { broadcast: { self: true } } })
  .on("broadcast", { event: "*" }, (msg) => say({ broadcast: msg }))
  .on("postgres_changes", { event: "UPDATE", schema: "public", table: "nodes" }, (msg) => say({ change: msg }));
const lobby = supabase.channel("lobby", { config: { presence: { key: "js" } } });
lobby.on("presence", { event: "sync" }, () => say({ presence: lobby.presenceState() }));

const mapStatus = await subscribed(map);
const lobbyStatus = await subscribed(lobby);
await lobby.track({ via: "supabase-js" });

// Someone else's private topic, as a signed-in user who does not own it: must be refused.
supabase.realtime.setAuth(userToken);
const spy = supabase.channel(`owner:${otherOwner}`, { config: { private: true } });
spy.on("broadcast", { event: "*" }, (msg) => say({ leaked: msg }));
const spyStatus = await subscribed(spy);

say({ ready: { map: mapStatus, lobby: lobbyStatus, spy: spyStatus } });

for await (const line of readline.createInterface({ input: process.stdin })) {
  const command = JSON.parse(line);
  if (command.broadcast) say({ sent: await map.send({ type: "broadcast", ...command.broadcast }) });
  if (command.quit) break;
}
await supabase.removeAllChannels();
process.exit(0);
