// A process agent in JavaScript, with no agl-stream code: agl-stream starts it once per
// attempt (`agl-stream worker runner --agent-command "node agent.mjs"`) with the
// attempt's environment, and it answers a question with the LLM and reports its reward.
//
//   AGL_TASK_INPUT       the task, as JSON: {"question": "...", "answer": "..."}
//   AGL_OPENAI_BASE_URL  the attempt's OpenAI-compatible URL (every call is recorded)
//   AGL_MODEL            the model to ask for
//   AGL_EVENT_URL        where to POST events and rewards
//   AGL_KEY              the attempt's key: send it as a bearer token to both URLs
const { AGL_TASK_INPUT, AGL_OPENAI_BASE_URL, AGL_MODEL, AGL_EVENT_URL, AGL_KEY } = process.env;
const task = JSON.parse(AGL_TASK_INPUT);
const headers = { "Content-Type": "application/json", Authorization: `Bearer ${AGL_KEY}` };

async function post(url, body) {
  const response = await fetch(url, { method: "POST", headers, body: JSON.stringify(body) });
  if (!response.ok) throw new Error(`${url}: ${response.status} ${await response.text()}`);
  return response.json();
}

const completion = await post(`${AGL_OPENAI_BASE_URL}/chat/completions`, {
  model: AGL_MODEL,
  messages: [
    { role: "system", content: "Answer with the number only." },
    { role: "user", content: task.question },
  ],
  max_tokens: 8,
});
const said = completion.choices[0].message.content ?? "";
const reward = said.trim() === String(task.answer) ? 1.0 : 0.0;
await post(AGL_EVENT_URL, [
  { type: "message", message: `answered ${JSON.stringify(said)}` },
  { type: "reward", value: reward },
]);
console.log(`${task.question} -> ${said.trim()} (reward ${reward})`);
// A non-zero exit (an uncaught error above included) fails the attempt; 0 succeeds it.
