// Copy the browser builds of the npm packages into static/vendor, where Django's staticfiles
// (served by whitenoise) find them: no CDN at run time. `make install` runs this after `npm ci`.
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const target = join(root, "static", "vendor");
const files = [
  ["node_modules/htmx.org/dist/htmx.min.js", "htmx.min.js"],
  ["node_modules/chart.js/dist/chart.umd.min.js", "chart.umd.min.js"],
  ["node_modules/chart.js/dist/chart.umd.min.js.map", "chart.umd.min.js.map"],
];
mkdirSync(target, { recursive: true });
for (const [source, name] of files) {
  copyFileSync(join(root, source), join(target, name));
  console.log(`static/vendor/${name}`);
}
