// Node-RED settings for the peer case of `benches/run` (issue 7). Loopback only, no editor, no
// admin API, warnings only: what a production flow would run with. `benches/run` sets PORT,
// UPSTREAM_URL, UPSTREAM_API_KEY and BENCH_WEBHOOK_TOKEN, and passes flow.json as the flow file.
module.exports = {
    uiHost: "127.0.0.1",
    uiPort: parseInt(process.env.PORT || "1880", 10),
    // No editor and no admin API: the flow is the file, nothing can redeploy it.
    httpAdminRoot: false,
    disableEditor: true,
    httpNodeRoot: "/",
    // The flow file holds no credentials (the API key comes from the environment).
    credentialSecret: false,
    flowFilePretty: true,
    functionExternalModules: false,
    logging: {
        console: { level: "warn", metrics: false, audit: false },
    },
    editorTheme: { projects: { enabled: false } },
};
