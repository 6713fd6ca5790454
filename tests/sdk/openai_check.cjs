// The OpenAI SDK's usual calls through `pagekv route` (tests/test_router.c starts the
// nodes and the router and runs this with NODE_PATH pointing at an `openai` install):
// list models, chat, streaming chat, completions, streaming completions. Exits 0 when
// every call worked and each streamed text equals the same request's non-streamed text.
//   node openai_check.cjs http://127.0.0.1:PORT
'use strict';
const OpenAI = require('openai');

function check(cond, what) {
    if (!cond) {
        console.error('openai sdk check failed: ' + what);
        process.exit(1);
    }
}

async function main() {
    const client = new OpenAI({baseURL: process.argv[2] + '/v1', apiKey: 'none', maxRetries: 0});
    const models = await client.models.list();
    const ids = models.data.map((m) => m.id);
    check(ids.includes('tiny'), 'models.list: ' + JSON.stringify(ids));

    const messages = [{role: 'user', content: 'Say something through the router'}];
    const chat = await client.chat.completions.create(
        {model: 'tiny', messages, max_tokens: 12, temperature: 0});
    const text = chat.choices[0].message.content;
    check(typeof text === 'string' && text.length > 0, 'chat: ' + JSON.stringify(chat));
    check(chat.usage.completion_tokens === 12 || chat.choices[0].finish_reason === 'stop',
          'chat usage: ' + JSON.stringify(chat.usage));

    const stream = await client.chat.completions.create(
        {model: 'tiny', messages, max_tokens: 12, temperature: 0, stream: true});
    let streamed = '', finish = null;
    for await (const chunk of stream) {
        const c = chunk.choices[0];
        if (c && c.delta && c.delta.content) streamed += c.delta.content;
        if (c && c.finish_reason) finish = c.finish_reason;
    }
    check(streamed === text, 'streamed chat differs: ' + JSON.stringify([streamed, text]));
    check(finish === chat.choices[0].finish_reason, 'streamed finish_reason ' + finish);

    const prompt = 'The router relays a completion';
    const comp = await client.completions.create(
        {model: 'tiny', prompt, max_tokens: 8, temperature: 0});
    check(comp.choices[0].text.length > 0, 'completions: ' + JSON.stringify(comp));
    const cs = await client.completions.create(
        {model: 'tiny', prompt, max_tokens: 8, temperature: 0, stream: true});
    let ctext = '';
    for await (const chunk of cs) ctext += chunk.choices[0] ? chunk.choices[0].text : '';
    check(ctext === comp.choices[0].text, 'streamed completion differs');

    let refused = null;
    try {
        await client.chat.completions.create({model: 'nope', messages});
    } catch (e) {
        refused = e;
    }
    check(refused && refused.status === 404, 'unknown model: ' + (refused && refused.status));
    console.log('openai sdk: models, chat, streaming chat, completions, streaming ok');
}

main().catch((e) => {
    console.error('openai sdk check failed: ' + (e && e.stack ? e.stack : e));
    process.exit(1);
});
