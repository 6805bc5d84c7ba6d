// What the functions answer with: OpenAI's error body (as the gateway sends it, see
// neuralgrid/gateway/errors.py), a JSON body read with a size limit, and the SQLSTATEs that are
// the caller's fault mapped to their HTTP status.

/** OpenAI's error codes by status, as the gateway names them. */
const CODES: Record<number, string> = {
  400: "invalid_request",
  401: "invalid_api_key",
  403: "forbidden",
  404: "not_found",
  405: "method_not_allowed",
  413: "request_too_large",
};

/** An OpenAI-shaped error response: {error: {message, type, param, code}}. */
export function error(
  status: number,
  message: string,
  param: string | null = null,
  code: string | null = CODES[status] ?? null,
): Response {
  const type = status >= 500 ? "server_error" : "invalid_request_error";
  const headers = status === 401 ? { "www-authenticate": "Bearer" } : undefined;
  return Response.json({ error: { message, type, param, code } }, { status, headers });
}

/** A failure that is already an HTTP answer. */
export class HttpError extends Error {
  constructor(readonly response: Response) {
    super(`HTTP ${response.status}`);
  }
}

/** The request's JSON body, at most `maxBytes` long; HttpError (400 or 413) otherwise. */
export async function readJson(req: Request, maxBytes: number): Promise<unknown> {
  const declared = Number(req.headers.get("content-length") ?? "0");
  if (declared > maxBytes) throw new HttpError(error(413, `the body is at most ${maxBytes} bytes`));
  const chunks: Uint8Array[] = [];
  let size = 0;
  if (req.body) {
    for await (const chunk of req.body) {
      size += chunk.byteLength;
      if (size > maxBytes) throw new HttpError(error(413, `the body is at most ${maxBytes} bytes`));
      chunks.push(chunk);
    }
  }
  const bytes = new Uint8Array(size);
  let at = 0;
  for (const chunk of chunks) {
    bytes.set(chunk, at);
    at += chunk.byteLength;
  }
  try {
    return JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes));
  } catch {
    throw new HttpError(error(400, "the body is not valid JSON"));
  }
}

/** The HTTP status of each database error the caller causes (SQLSTATE), as the gateway maps them
 * (neuralgrid/db/errors.py), plus 28000 for a node secret that is not the node's. */
export const SQLSTATE_STATUS: Record<string, number> = {
  "28000": 401, // invalid_authorization_specification: a node secret that is not the node's
  "42501": 403, // insufficient_privilege: the caller's role may not do this (grants, RLS)
  P0002: 404, // no_data_found: no such model, no such node
  "22023": 400, // invalid_parameter_value
  "22P02": 400, // invalid_text_representation
  "22P05": 400, // untranslatable_character (\u0000 in jsonb)
  "22003": 400, // numeric_value_out_of_range
  "23502": 400, // not_null_violation
  "23503": 400, // foreign_key_violation
  "23514": 400, // check_violation
};

/** The answer for a database error the caller caused; rethrows anything else (a 500). */
export function databaseError(err: unknown, param: (status: number) => string | null = () => null): Response {
  const code = (err as { code?: unknown }).code;
  const status = typeof code === "string" ? SQLSTATE_STATUS[code] : undefined;
  if (status === undefined) throw err;
  return error(status, (err as Error).message, param(status));
}
