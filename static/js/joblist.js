// The job list's "Compare selected": the checked rows' ids, kept in sessionStorage so a selection
// survives paging, sorting and filtering (pick two jobs from different pages), and the button opens
// /compare/?jobs=<id>,<id>,... (the comparison page, issue 25 section 2) in the order they were picked.
const KEY = "trainyard.compare";
const button = document.getElementById("compare-selected");
const count = document.getElementById("compare-count");

function load() {
  try {
    const ids = JSON.parse(sessionStorage.getItem(KEY) || "[]");
    return Array.isArray(ids) ? ids.filter((id) => Number.isInteger(id) && id > 0) : [];
  } catch {
    return [];
  }
}

let picked = load();

function save() {
  sessionStorage.setItem(KEY, JSON.stringify(picked));
  count.textContent = `(${picked.length})`;
  button.disabled = picked.length < 2;
  button.title = picked.length < 2 ? "select two or more jobs" : `compare jobs ${picked.join(", ")}`;
}

for (const box of document.querySelectorAll("#job-table input.pick")) {
  const id = Number(box.value);
  box.checked = picked.includes(id);
  box.addEventListener("change", () => {
    picked = picked.filter((p) => p !== id);
    if (box.checked) picked.push(id);
    save();
  });
}

button.addEventListener("click", () => {
  if (picked.length < 2) return;
  const ids = picked.join(",");
  picked = [];
  save();
  window.location.assign(`/compare/?jobs=${ids}`);
});

save();
