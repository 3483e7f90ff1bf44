// diffuserve playground: talks only to this server (same origin), no third-party code.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { apiKey: "", info: null, kind: "image", polling: new Map() };

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.apiKey) h["Authorization"] = "Bearer " + state.apiKey;
  return h;
}

function setStatus(text) { $("status").textContent = text; }

function showError(text) {
  const box = $("error");
  box.textContent = text || "";
  box.hidden = !text;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error) return `${response.status}: ${body.error.message}` + (body.error.param ? ` (${body.error.param})` : "");
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status}`;
}

// -- server facts ------------------------------------------------------------------------------

async function loadInfo() {
  const response = await fetch("/server_info", { headers: headers(false) });
  if (!response.ok) {
    showError(await errorText(response));
    return;
  }
  showError("");
  const info = await response.json();
  state.info = info;
  state.kind = (info.pipeline && info.pipeline.output_kind) || "image";
  $("model-name").textContent = info.served_model_name;
  $("model-kind").textContent = info.pipeline ? `(${info.pipeline.family}, ${state.kind})` : "";
  $("plan").textContent = JSON.stringify(info.deployment_plan, null, 2);
  const d = info.defaults || {};
  if (!$("size").value && d.width) $("size").value = `${d.width}x${d.height}`;
  if (!$("steps").value && d.num_inference_steps) $("steps").value = d.num_inference_steps;
  if (!$("guidance").value && d.guidance_scale !== undefined) $("guidance").value = d.guidance_scale;
  if (!$("num-frames").value && d.num_frames) $("num-frames").value = d.num_frames;
  if (!$("fps").value && d.fps) $("fps").value = d.fps;
  const video = state.kind === "video";
  document.querySelectorAll(".video-only").forEach((el) => { el.hidden = !video; });
  document.querySelectorAll(".image-only").forEach((el) => { el.hidden = video; });
  $("videos").hidden = !video;
  $("generate").disabled = false;
  if (video) refreshJobs();
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function commonBody() {
  const body = { prompt: $("prompt").value };
  const negative = $("negative-prompt").value.trim();
  if (negative) body.negative_prompt = negative;
  const size = $("size").value.trim();
  if (size) body.size = size;
  for (const [id, key] of [["steps", "num_inference_steps"], ["guidance", "guidance_scale"], ["seed", "seed"]]) {
    const value = numberField(id);
    if (value !== undefined) body[key] = value;
  }
  return body;
}

// -- images: Server-Sent Events of partial and final images -----------------------------------------

function figureFor(index) {
  let figure = document.querySelector(`figure[data-index="${index}"]`);
  if (!figure) {
    figure = document.createElement("figure");
    figure.dataset.index = String(index);
    const img = document.createElement("img");
    img.alt = `output ${index}`;
    const caption = document.createElement("figcaption");
    figure.append(img, caption);
    $("images").append(figure);
  }
  return figure;
}

function showImage(event) {
  const index = event.output_index || 0;
  const figure = figureFor(index);
  const img = figure.querySelector("img");
  const final = event.type.endsWith(".completed");
  img.src = `data:image/${event.output_format};base64,${event.b64_json}`;
  img.className = final ? "final" : "partial";
  if (!final) figure.dataset.partials = String(Number(figure.dataset.partials || 0) + 1);
  figure.querySelector("figcaption").textContent = final
    ? `final ${event.size}`
    : `partial ${event.partial_image_index + 1}`;
}

function parseEvents(buffer, onEvent) {
  // SSE: events are separated by a blank line; each has `event:` and `data:` lines.
  let cut;
  while ((cut = buffer.indexOf("\n\n")) >= 0) {
    const block = buffer.slice(0, cut);
    buffer = buffer.slice(cut + 2);
    let name = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) name = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
    }
    if (data.length) onEvent(name, JSON.parse(data.join("\n")));
  }
  return buffer;
}

async function generateImages() {
  const body = { ...commonBody(), n: numberField("n") || 1, stream: true,
                 partial_images: numberField("partial-images") ?? 0, response_format: "b64_json" };
  $("images").replaceChildren();
  setStatus("Generating…");
  const response = await fetch("/v1/images/generations", { method: "POST", headers: headers(true), body: JSON.stringify(body) });
  if (!response.ok) throw new Error(await errorText(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let done = 0;
  for (;;) {
    const chunk = await reader.read();
    if (chunk.done) break;
    buffer = parseEvents(buffer + decoder.decode(chunk.value, { stream: true }), (name, event) => {
      if (name === "error") throw new Error(event.error ? event.error.message : "stream error");
      showImage(event);
      if (event.type.endsWith(".completed")) done += 1;
      setStatus(done ? `${done}/${body.n} image(s) done` : `partial image ${event.partial_image_index + 1}`);
    });
  }
  setStatus(`Done: ${done} image(s).`);
}

// -- videos: jobs with progress and a player ---------------------------------------------------------

function jobItem(job) {
  let item = document.querySelector(`li[data-id="${job.id}"]`);
  if (!item) {
    item = document.createElement("li");
    item.dataset.id = job.id;
    const title = document.createElement("div");
    title.className = "title";
    const bar = document.createElement("progress");
    bar.max = 100;
    item.append(title, bar);
    $("jobs").prepend(item);
  }
  item.querySelector(".title").textContent = `${job.prompt} — ${job.status} ${job.progress}% (${job.size}, ${job.seconds}s)`
    + (job.error ? ` — ${job.error.message}` : "");
  item.querySelector("progress").value = job.progress;
  item.dataset.status = job.status;
  return item;
}

async function attachPlayer(job, item) {
  if (item.querySelector("video")) return;
  const response = await fetch(`/v1/videos/${job.id}/content`, { headers: headers(false) });
  if (!response.ok) return;
  const video = document.createElement("video");
  video.controls = true;
  video.loop = true;
  video.src = URL.createObjectURL(await response.blob());
  item.append(video);
}

function pollJob(id) {
  if (state.polling.has(id)) return;
  const tick = async () => {
    const response = await fetch(`/v1/videos/${id}`, { headers: headers(false) });
    if (!response.ok) { state.polling.delete(id); return; }
    const job = await response.json();
    const item = jobItem(job);
    if (job.status === "completed") await attachPlayer(job, item);
    if (["completed", "failed", "cancelled"].includes(job.status)) state.polling.delete(id);
    else state.polling.set(id, setTimeout(tick, 500));
  };
  state.polling.set(id, setTimeout(tick, 0));
}

async function refreshJobs() {
  const response = await fetch("/v1/videos?limit=20", { headers: headers(false) });
  if (!response.ok) return;
  const page = await response.json();
  for (const job of page.data.reverse()) {
    const item = jobItem(job);
    if (job.status === "completed") attachPlayer(job, item);
    else if (!["failed", "cancelled"].includes(job.status)) pollJob(job.id);
  }
}

async function createVideo() {
  const body = commonBody();
  for (const [id, key] of [["num-frames", "num_frames"], ["fps", "fps"]]) {
    const value = numberField(id);
    if (value !== undefined) body[key] = value;
  }
  const response = await fetch("/v1/videos", { method: "POST", headers: headers(true), body: JSON.stringify(body) });
  if (!response.ok) throw new Error(await errorText(response));
  const job = await response.json();
  jobItem(job);
  setStatus(`Job ${job.id} queued.`);
  pollJob(job.id);
}

// -- wiring -------------------------------------------------------------------------------------------

async function onSubmit(event) {
  event.preventDefault();
  showError("");
  $("generate").disabled = true;
  try {
    if (state.kind === "video") await createVideo();
    else await generateImages();
  } catch (err) {
    showError(String(err.message || err));
    setStatus("");
  } finally {
    $("generate").disabled = false;
  }
}

async function start() {
  $("generate-form").addEventListener("submit", onSubmit);
  $("connect").addEventListener("click", () => { state.apiKey = $("api-key").value; loadInfo(); });
  const config = await (await fetch("/playground/config.json")).json();
  if (config.auth_required) {
    $("auth").hidden = false;
    setStatus("This server needs an API key.");
    return;
  }
  await loadInfo();
}

document.addEventListener("DOMContentLoaded", start);
