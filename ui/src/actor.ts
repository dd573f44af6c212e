// Who acts: every action that changes something asks for the operator's name, and the
// console remembers the last one given in this browser, for every form alike.
import { useState, type FormEvent } from 'react'

const KEY = 'spillway.actor'

/** The operator's name as a form field, prefilled with the last one used; `remember` keeps
 * it once the action is sent. */
function useActor(): { actor: string; setActor: (v: string) => void; remember: () => void } {
  const [actor, setActor] = useState(() => localStorage.getItem(KEY) ?? '')
  return { actor, setActor, remember: () => localStorage.setItem(KEY, actor.trim()) }
}

/** What an action came to, in words. */
export type Outcome = { ok: boolean; text: string }

/** A form that changes something on an operator's word: their name (remembered once
 * sent) and reason, busy while the action runs, and its outcome. `act(action)` is the
 * form's submit handler; `action` returns the message to show, or null for none, and
 * its error becomes the message. */
export function useOperatorAction() {
  const { actor, setActor, remember } = useActor()
  const [reason, setReason] = useState('')
  const [busy, setBusy] = useState(false)
  const [msg, setMsg] = useState<Outcome | null>(null)
  const act = (action: () => Promise<Outcome | null>) => async (e: FormEvent) => {
    e.preventDefault()
    setBusy(true)
    setMsg(null)
    try {
      remember()
      setMsg(await action())
    } catch (err) {
      setMsg({ ok: false, text: (err as Error).message })
    } finally {
      setBusy(false)
    }
  }
  return { actor, setActor, reason, setReason, busy, msg, act }
}
