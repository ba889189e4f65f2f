// A process agent in JavaScript, with no agl-stream code: it reads its attempt's environment,
// calls the LLM through its gateway URL with its key, tries the event URL without the key and
// with a bad event, posts a message and the reward its task names, and prints what it saw.
const env = process.env;
const task = JSON.parse(env.AGL_TASK_INPUT);
const json = { "Content-Type": "application/json" };
const withKey = { ...json, Authorization: `Bearer ${env.AGL_KEY}` };

async function post(url, body, headers = withKey) {
  const response = await fetch(url, { method: "POST", headers, body: JSON.stringify(body) });
  return [response.status, await response.json()];
}

let stdin = "";
for await (const chunk of process.stdin) stdin += chunk;

const report = { stdin_is_the_task: JSON.stringify(JSON.parse(stdin)) === JSON.stringify(task) };
const [llmStatus, answer] = await post(`${env.AGL_OPENAI_BASE_URL}/chat/completions`, {
  model: env.AGL_MODEL,
  messages: [{ role: "user", content: task.question }],
  max_tokens: 6,
});
report.llm = llmStatus;
report.answered = typeof answer.choices?.[0]?.message?.content === "string";
report.llm_without_key = (await post(`${env.AGL_OPENAI_BASE_URL}/chat/completions`, {}, json))[0];
report.event_without_key = (await post(env.AGL_EVENT_URL, { type: "message", message: "x" }, json))[0];
report.bad_event = (await post(env.AGL_EVENT_URL, { type: "nope" }))[0];
report.events = (
  await post(env.AGL_EVENT_URL, [
    { type: "message", message: "answered" },
    { event_type: "reward", data: { value: task.reward } },
  ])
)[0];
console.log(JSON.stringify(report));
