// The new-run form: a chosen file is what the run trains on (frontend.forms.NewRunForm), so
// choosing one switches the task-set list to "upload a new one" and names the new task set after
// the file when no name is given; choosing a task set from the list drops a chosen file. The
// form then shows the task set the run will use (the list is preselected with the newest one).
(function () {
  "use strict";
  const list = document.getElementById("id_task_set");
  const file = document.getElementById("id_task_file");
  const name = document.getElementById("id_task_set_name");
  if (!list || !file) return;
  file.addEventListener("change", function () {
    if (!file.files.length) return;
    list.value = "";
    if (name && !name.value.trim()) {
      // A task-set name: lowercase letters, digits, ".", "_" or "-", at most 63 characters.
      name.value = file.files[0].name.replace(/\.jsonl?$/i, "").toLowerCase()
        .replace(/[^a-z0-9._-]+/g, "-").replace(/^[-._]+|[-._]+$/g, "").slice(0, 63);
    }
  });
  list.addEventListener("change", function () {
    if (list.value) file.value = "";
  });
})();
