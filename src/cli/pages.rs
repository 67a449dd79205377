//! List commands: pages of an admin list, through the daemon or from the store.

use super::admin::{enc, online, print_found};
use super::{CliError, PageArgs};
use handoff_bridge::config::Config;
use handoff_bridge::queries::{List, PAGE_MAX};
use serde_json::Value;
use storage::Store;

/// Pages of an admin list (`queries::List`): through the running daemon, else from the store
/// (opened once, on the first page that needs it). Both answer the same JSON.
pub(super) struct Pager<'a> {
    config: &'a Config,
    list: List,
    store: Option<Store>,
}

impl<'a> Pager<'a> {
    /// A pager of `list` that has asked nothing yet.
    pub(super) fn new(config: &'a Config, list: List) -> Self {
        Pager {
            config,
            list,
            store: None,
        }
    }

    /// The page of `limit` items (the default when `None`) after the cursor `after`; a bad
    /// limit or cursor is refused here, before anything is asked.
    pub(super) fn page(
        &mut self,
        limit: Option<usize>,
        after: Option<&str>,
    ) -> Result<Value, CliError> {
        let limit = limit.map(|l| l.to_string());
        let query = self
            .list
            .query(limit.as_deref(), after)
            .map_err(|e| CliError::Usage(e.to_string()))?;
        if self.store.is_none() {
            let params: Vec<String> = [("limit", limit.as_deref()), ("after", after)]
                .into_iter()
                .filter_map(|(k, v)| v.map(|v| format!("{k}={}", enc(v))))
                .collect();
            let path = format!("{}?{}", self.list.path(), params.join("&"));
            if let Some(found) = online(self.config, "GET", &path)? {
                return Ok(found.unwrap_or(Value::Null));
            }
        }
        let store = match self.store.take() {
            Some(store) => store,
            None => super::open_store(self.config)?,
        };
        let value = query.read(&*store).and_then(|mut value| {
            // What the daemon's executor adds: a stopped store has no executor running.
            if let (List::Outbox, Some(obj)) = (self.list, value.as_object_mut()) {
                obj.insert("paused".into(), Value::Bool(false));
                obj.insert("depth".into(), store.outbox_len()?.into());
            }
            Ok(value)
        });
        self.store = Some(store);
        Ok(value?)
    }
}

/// The items of a page of `list`.
pub(super) fn items(page: &Value, list: List) -> impl Iterator<Item = &Value> {
    page[list.items()].as_array().into_iter().flatten()
}

/// A page's `next` as the next page's `after` (a number or an opaque string); `None` after the
/// last page.
pub(super) fn next_cursor(page: &Value) -> Option<String> {
    match page.get("next")? {
        Value::Number(n) => Some(n.to_string()),
        Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

/// What a list command prints without `--limit`, `--after` or `--all`.
#[derive(Clone, Copy)]
pub(super) enum Unpaged {
    /// The first page (the default limit), as the admin API answers it.
    FirstPage,
    /// Every item, as one JSON object: the first page's own fields, the items, their `count`.
    Object,
    /// Every item, as one JSON array.
    Array,
}

/// A list command: one page (`--limit`, `--after`), every item as JSON lines (`--all`), or what
/// the command shows without flags. Never more than one page in memory.
pub(super) fn list_command(
    config: &Config,
    list: List,
    args: PageArgs,
    unpaged: Unpaged,
) -> Result<(), CliError> {
    let mut pages = Pager::new(config, list);
    if args.all {
        let limit = Some(args.limit.unwrap_or(PAGE_MAX));
        let mut after = args.after;
        loop {
            let page = pages.page(limit, after.as_deref())?;
            for item in items(&page, list) {
                out!("{item}");
            }
            match next_cursor(&page) {
                Some(next) => after = Some(next),
                None => return Ok(()),
            }
        }
    }
    match (args.paging(), unpaged) {
        (true, _) | (false, Unpaged::FirstPage) => {
            let page = pages.page(args.limit, args.after.as_deref())?;
            print_found(Some(page), String::new)
        }
        (false, Unpaged::Object) => whole_object(pages),
        (false, Unpaged::Array) => whole_array(pages),
    }
}

/// Every item as one JSON array, printed as the pages come.
fn whole_array(mut pages: Pager<'_>) -> Result<(), CliError> {
    let list = pages.list;
    let (mut after, mut first) = (None, true);
    out_raw!("[");
    loop {
        let page = pages.page(Some(PAGE_MAX), after.as_deref())?;
        for item in items(&page, list) {
            let text = serde_json::to_string_pretty(item).unwrap_or_default();
            out_raw!(
                "{}\n  {}",
                if first { "" } else { "," },
                text.replace('\n', "\n  ")
            );
            first = false;
        }
        match next_cursor(&page) {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    out!("{}", if first { "]" } else { "\n]" });
    Ok(())
}

/// Every item as one JSON object (the first page's fields, the items of every page, and their
/// `count`), printed as the pages come.
fn whole_object(mut pages: Pager<'_>) -> Result<(), CliError> {
    let list = pages.list;
    let mut page = pages.page(Some(PAGE_MAX), None)?;
    // The first page's own fields (paused, depth), then the items as they come.
    let mut head = serde_json::Map::new();
    if let Some(obj) = page.as_object() {
        for (k, v) in obj {
            if !matches!(k.as_str(), "count" | "next") && k != list.items() {
                head.insert(k.clone(), v.clone());
            }
        }
    }
    let mut count = 0usize;
    out_raw!("{{");
    for (k, v) in &head {
        out_raw!("\n  {}: {},", Value::String(k.clone()), v);
    }
    out_raw!("\n  \"{}\": [", list.items());
    loop {
        for item in items(&page, list) {
            let text = serde_json::to_string_pretty(item).unwrap_or_default();
            out_raw!(
                "{}\n    {}",
                if count == 0 { "" } else { "," },
                text.replace('\n', "\n    ")
            );
            count += 1;
        }
        match next_cursor(&page) {
            Some(next) => page = pages.page(Some(PAGE_MAX), Some(&next))?,
            None => break,
        }
    }
    out!(
        "{}\n  \"count\": {count}\n}}",
        if count == 0 { "]," } else { "\n  ]," }
    );
    Ok(())
}
