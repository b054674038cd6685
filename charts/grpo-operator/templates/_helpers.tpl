{{/* Names and labels. */}}
{{- define "grpo-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "grpo-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "grpo-operator.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "grpo-operator.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "grpo-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "grpo-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "grpo-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "grpo-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "grpo-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "grpo-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "grpo-operator.image" -}}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) }}
{{- end }}

{{/*
The operator's permissions: exactly what grpo_operator uses (kube.py, reconciler.py, kopf).
Server-side apply is a `patch`, and a `create` too when the object doesn't exist yet.
*/}}
{{- define "grpo-operator.rules" -}}
# GRPOJobs: kopf watches them; the reconciler reads one at a time and deletes it when its
# runPolicy.ttlSecondsAfterFinished has passed.
- apiGroups: ["grpo.dev"]
  resources: ["grpojobs"]
  verbs: ["get", "list", "watch", "delete"]
# The status is the operator's alone (a merge patch of the status subresource).
- apiGroups: ["grpo.dev"]
  resources: ["grpojobs/status"]
  verbs: ["patch"]
# Children carry ownerReferences with blockOwnerDeletion: clusters that enable the
# OwnerReferencesPermissionEnforcement admission plugin require this on the owner.
- apiGroups: ["grpo.dev"]
  resources: ["grpojobs/finalizers"]
  verbs: ["update"]
# <job>-spec ConfigMap and the headless Services: server-side applied. The ConfigMap is read
# back (get) for the job defaults pinned in it at the job's first reconcile.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "patch"]
# <job>-rpc token: created once, never read back, updated or listed.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"{{ if .Values.operator.readStorageSecrets }}, "get"{{ end }}]
# Pods: why they are Pending, how a trainer exited (label-selected watch and list). A failed
# attempt's trainer pods are kept for `kubectl logs`: owned by the GRPOJob too (patch), and
# deleted once the next attempt runs (delete).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch", "delete"]
# The reward and sandbox pods' logs, kept in the run before they are scaled away (they can't
# write storage themselves: grpo_operator/server_logs.py).
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Events on GRPOJobs (the operator's and kopf's).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# The trainer's Indexed Job: watched, replaced on failure (delete + create), never patched
# (Kueue, not the operator, unsuspends a queued one).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
# The rollout Deployment: applied, scaled (patch), removed on suspend.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
# Kueue: why a queued trainer Job isn't admitted yet (its Workload's conditions, for the status).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list"]
# Gang scheduling (spec.runPolicy.schedulingPolicy): the trainer's PodGroup, server-side applied.
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["create", "patch"]
{{- if .Values.jobDefaults.networkPolicy.enabled }}
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch"]
{{- end }}
{{- if and (ne (toString .Values.jobDefaults.podMonitor) "false") (not .Values.metrics.podMonitor.enabled) }}
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["create", "patch"]
{{- end }}
{{- end }}
